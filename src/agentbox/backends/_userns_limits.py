"""Per-sandbox caps on the kernel counters charged to the owner of its user namespace.

The kernel charges some per-user counters at every level of the user-namespace
tree (``inc_ucount``/``inc_rlimit_ucounts``), up to the user that owns the
top-level namespace. podman, running as root, makes each sandbox's user namespace
owned by root, so what a sandbox spends is also spent from *root's* host-wide
quota. Measured here on runc (issue 18, item 2): a sandbox that called
``inotify_init1`` until it failed got all 128 of ``fs.inotify.max_user_instances``,
and root on the host got EMFILE at once; the same held for POSIX message queues
(9 queues spent root's 800 KiB ``RLIMIT_MSGQUEUE``) and queued real-time signals
(96,357 spent root's ``RLIMIT_SIGPENDING``).

A user namespace owned by an unprivileged user would make the chain end at that
user instead of root. podman 4.3 cannot do that here: ``--userns ns:PATH`` (join a
namespace we made as another owner) is refused together with ``--uidmap``, and
without it podman maps only ``0:0:1`` and the sandbox uid is not mapped (tried).
So each counter is bounded instead, per sandbox, and the host's limits are sized
above tasks x cap:

* ``/proc/sys/user/max_*`` are per user namespace, and the kernel checks a
  namespace's own maximum before it charges the level above. An OCI ``prestart``
  hook (:mod:`agentbox.backends._userns_hook`, run by runc as root after the
  namespaces exist and before the workload starts) writes :data:`SANDBOX_CAPS`
  into the sandbox's namespace. The hook fails closed: if it cannot write, runc
  does not start the container.
* rlimit-backed counters (``RLIMIT_SIGPENDING``, ``RLIMIT_MSGQUEUE``) are checked
  against the process's own rlimit at the sandbox's level; podman's ``--ulimit``
  sets them (:data:`SANDBOX_RLIMITS`).
* the host limits for root (:data:`HOST_SYSCTLS`) leave room for
  :data:`HOST_SANDBOXES` sandboxes at their caps plus root's own use; they are
  set by ``scripts/setup.sh`` and checked by ``agentbox doctor``.

Under gVisor (runsc) a workload's inotify, message queues and signals are the
Sentry's own (measured: 4,093 instances inside, the host untouched); the hook
still caps the namespace the Sentry runs in. docs/explanation/threat-model.md has
the audit of every counter.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import resources
from pathlib import Path

from agentbox.errors import UnsupportedError

__all__ = [
    "HOST_SANDBOXES",
    "HOST_SYSCTLS",
    "SANDBOX_CAPS",
    "SANDBOX_RLIMITS",
    "hooks_dir",
    "host_shortfall",
]

#: Written into each sandbox's own user namespace (``/proc/sys/user/NAME``).
#: inotify: node's and Claude Code's watchers need a handful of instances and a watch
#: per watched directory; each watch is charged to the sandbox's memory cgroup.
#: Namespaces and fanotify: the workload cannot make any (seccomp refuses
#: CLONE_NEWUSER, it holds no CAP_SYS_ADMIN, fanotify_init needs it); 0 says so twice.
SANDBOX_CAPS: dict[str, int] = {
    "max_inotify_instances": 64,
    "max_inotify_watches": 32768,
    "max_fanotify_groups": 0,
    "max_fanotify_marks": 0,
    "max_user_namespaces": 0,
    "max_mnt_namespaces": 0,
    "max_pid_namespaces": 0,
    "max_net_namespaces": 0,
    "max_ipc_namespaces": 0,
    "max_uts_namespaces": 0,
    "max_cgroup_namespaces": 0,
    "max_time_namespaces": 0,
}

#: ``podman run --ulimit`` values (soft = hard). 0 message-queue bytes: no agent tool
#: uses POSIX message queues. 1024 queued signals: far above what a shell or node needs.
SANDBOX_RLIMITS: dict[str, int] = {"sigpending": 1024, "msgqueue": 0}

#: How many sandboxes at their caps the host's limits for root must leave room for.
HOST_SANDBOXES = 128
#: What root itself keeps (the kernel's defaults for one user).
_ROOT_OWN = {"max_user_instances": 128, "max_user_watches": 65536}

#: Host sysctls (``fs.inotify.*``: root's quota, the top level of every sandbox's chain).
HOST_SYSCTLS: dict[str, int] = {
    "fs.inotify.max_user_instances": SANDBOX_CAPS["max_inotify_instances"] * HOST_SANDBOXES
    + _ROOT_OWN["max_user_instances"],
    "fs.inotify.max_user_watches": SANDBOX_CAPS["max_inotify_watches"] * HOST_SANDBOXES
    + _ROOT_OWN["max_user_watches"],
}

_HOOK_NAME = "agentbox-userns-limits.json"


def host_shortfall(proc_sys: Path = Path("/proc/sys")) -> dict[str, tuple[int, int]]:
    """``{sysctl: (current, wanted)}`` for every host limit below :data:`HOST_SYSCTLS`."""
    short: dict[str, tuple[int, int]] = {}
    for name, want in HOST_SYSCTLS.items():
        path = proc_sys / name.replace(".", "/")
        try:
            have = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            have = -1
        if have < want:
            short[name] = (have, want)
    return short


def _hook_config(script: Path, python: str) -> dict[str, object]:
    args = [python, "-I", "-S", str(script)]
    args += [f"{k}={v}" for k, v in sorted(SANDBOX_CAPS.items())]
    # "always": the hooks dir is ours, passed only on agentbox's own `podman run`s.
    return {
        "version": "1.0.0",
        "hook": {"path": python, "args": args, "timeout": 10},
        "when": {"always": True},
        "stages": ["prestart"],
    }


def hooks_dir(cache_dir: Path, python: str | None = None) -> Path:
    """Write (once per content) the OCI hooks dir that caps a sandbox's user namespace.

    The hook script is a copy of :mod:`agentbox.backends._userns_hook` (stdlib only),
    root-owned and read-only: runc runs it as root.
    """
    python = python or sys.executable
    source = resources.files("agentbox.backends").joinpath("_userns_hook.py").read_bytes()
    digest = hashlib.sha256(
        source + json.dumps([python, sorted(SANDBOX_CAPS.items())]).encode()
    ).hexdigest()[:16]
    root = cache_dir / "oci-hooks" / digest
    hooks = root / "hooks.d"
    script = root / "userns_hook.py"
    if not (hooks / _HOOK_NAME).exists():
        hooks.mkdir(parents=True, exist_ok=True)
        for d in (root.parent, root, hooks):
            d.chmod(0o755)
        _write(script, source, 0o555)
        config = json.dumps(_hook_config(script, python), indent=1).encode()
        _write(hooks / _HOOK_NAME, config, 0o444)
    _check_owned(cache_dir, [root.parent, root, hooks, script, hooks / _HOOK_NAME])
    return hooks


def _check_owned(cache_dir: Path, paths: list[Path]) -> None:
    """The runtime runs the hook as root: nobody else may have written any part of it."""
    me = os.geteuid()
    for path in paths:
        st = path.lstat()
        if st.st_uid != me or st.st_mode & 0o022 or path.is_symlink():
            raise UnsupportedError(
                f"OCI hook path {path} is not owned by uid {me} or is writable by others",
                fix=f"remove {cache_dir / 'oci-hooks'} (agentbox rewrites it)",
            )


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)
