#!/usr/bin/env python3
"""OCI ``prestart`` hook: cap the per-user kernel counters of a sandbox's user namespace.

Stdlib only; the runtime (runc) runs it as root on the host, after the
container's namespaces exist and before its process starts, with the OCI state
(JSON: ``id``, ``pid``, …) on stdin and ``NAME=VALUE`` arguments such as
``max_inotify_instances=64``.

Why: the kernel charges inotify instances and watches (and the other
``/proc/sys/user/*`` counters) to the user at every level of the user-namespace
tree, up to the owner of the top one. podman (as root) makes every sandbox's user
namespace owned by root, so without a cap one sandbox can spend root's host-wide
quota (``fs.inotify.max_user_instances``: 128 by default) and stop root and every
other sandbox from watching files. The files under ``/proc/sys/user/`` are per
user namespace: writing them *from inside* the sandbox's namespace sets that
namespace's own maximum, which the kernel checks before it charges the level
above. So each sandbox can spend at most its cap of root's quota, and the host's
limits (``scripts/setup.sh``, checked by ``agentbox doctor``) are sized to
tasks x cap.

How: ``setns`` into the container's user namespace (root outside holds every
capability in it, so ``CAP_SYS_RESOURCE`` there is ours), write each value, read
it back, exit 0. Any failure exits non-zero, and the runtime then refuses to
start the container: the cap fails closed. A process already in this process's
own user namespace (gVisor's sandbox, whose workload's inotify is the Sentry's
own) is left alone: writing there would change the *host's* limits.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from pathlib import Path

CLONE_NEWUSER = 0x10000000
_NAME = re.compile(r"^max_[a-z_]+$")


def _parse(argv: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for arg in argv:
        name, sep, value = arg.partition("=")
        if not sep or not _NAME.match(name) or not value.isdigit():
            raise ValueError(f"bad limit argument {arg!r}")
        out[name] = int(value)
    return out


def _ns_id(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_dev, st.st_ino


def apply(pid: int, limits: dict[str, int]) -> str:
    """Enter ``pid``'s user namespace and write ``limits``; return what was done."""
    host = _ns_id("/proc/self/ns/user")
    if _ns_id(f"/proc/{pid}/ns/user") == host:
        return f"pid {pid} shares this user namespace: nothing to cap (gVisor's own counters)"
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the user namespace of pid {pid}")
    finally:
        os.close(fd)
    if _ns_id("/proc/self/ns/user") == host:
        # Defence in depth: never write the host's own (top-level) limits.
        raise OSError("setns left us in the host's user namespace")
    done = []
    for name, value in sorted(limits.items()):
        path = f"/proc/sys/user/{name}"
        if not Path(path).exists():
            continue  # an older kernel without this counter
        Path(path).write_text(f"{value}\n")
        seen = int(Path(path).read_text().strip())
        if seen != value:
            raise OSError(f"{path} reads {seen} after writing {value}")
        done.append(f"{name}={value}")
    return "capped " + " ".join(done)


def main(argv: list[str]) -> int:
    try:
        limits = _parse(argv)
        state = json.loads(sys.stdin.read(1 << 20))
        pid = state.get("pid") if isinstance(state, dict) else None
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise ValueError(f"OCI state has no usable pid: {pid!r}")
        apply(pid, limits)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"agentbox userns-limits hook: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
