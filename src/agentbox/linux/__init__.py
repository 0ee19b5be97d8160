"""Kernel plumbing said once: POSIX ACLs and the host's cgroup hierarchies."""
