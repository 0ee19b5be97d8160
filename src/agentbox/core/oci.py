"""The OCI runtimes podman runs agentbox's containers with, and which of them run on
the host's kernel: one fact shared by the podman backend (its ``runtimes`` and
``shares_host_kernel``) and the image build (``podman build --runtime``), below both so
the image package never asks a backend.
"""

from __future__ import annotations

__all__ = ["HOST_KERNEL_RUNTIMES", "PODMAN_RUNTIMES"]

#: What the podman backend runs (its first: podman's default, the build's fallback).
PODMAN_RUNTIMES: tuple[str, ...] = ("runc", "crun", "runsc")
#: The runtimes that run containers on the host's kernel (gVisor's runsc brings its own).
HOST_KERNEL_RUNTIMES = frozenset({"runc", "crun"})
