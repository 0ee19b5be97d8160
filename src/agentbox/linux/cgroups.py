"""The host's cgroup hierarchies as this process sees them (stdlib only).

One reading of ``/proc/self/mountinfo`` and ``/proc/<pid>/cgroup`` for the three
places that move a process of ours out of the launcher's systemd unit before a unit
stop can reach it: podman's conmon (``backends.podman._cgroup``), a detached microVM's
monitor (``backends.qemu._records``) and the per-task gateway (``gateway._process``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ENTER_THEN_EXEC",
    "UNIT_KEYS",
    "cgroup_mounts",
    "cgroups_of",
    "enter_then_exec",
    "unit_hierarchies",
]

#: The hierarchies systemd tracks (and kills) a unit by: cgroup v1's ``name=systemd``
#: and the unified one (``0``), as keys of :func:`cgroup_mounts` and :func:`cgroups_of`.
UNIT_KEYS = ("name=systemd", "0")

#: ``sh -c`` script: enter each ``cgroup.procs`` file named before ``--`` with the
#: shell's own pid, then ``exec`` the rest (the same pid: the command, and what it
#: forks, start where the shell went). A file it cannot enter is said on stderr and
#: skipped (the caller's move after the start is the second line).
ENTER_THEN_EXEC = (
    'while [ "$#" -gt 0 ] && [ "$1" != -- ]; do '
    '{ echo $$ > "$1"; } 2>/dev/null || echo "agentbox: could not enter $1" >&2; shift; '
    'done; shift; exec "$@"'
)


def cgroup_mounts() -> dict[str, Path]:
    """Hierarchy key (``0`` for cgroup2, else each controller or ``name=…``) → mount point."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.setdefault("0", Path(fields[4]))
        elif tail[0] == "cgroup":
            for opt in tail[2].split(","):
                if opt not in ("rw", "ro", "relatime"):
                    found.setdefault(opt, Path(fields[4]))
    return found


def cgroups_of(pid: int | str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as hierarchy key → path (key: ``0`` or the first controller)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            num, ctrls, path = ([*line.split(":", 2), "", ""])[:3]
            key = "0" if num == "0" and not ctrls else ctrls.split(",")[0]
            out[key] = path
    return out


def unit_hierarchies() -> dict[str, Path]:
    """The mount points of the :data:`UNIT_KEYS` hierarchies this process sees."""
    mounts = cgroup_mounts()
    return {key: mounts[key] for key in UNIT_KEYS if key in mounts}


def enter_then_exec(procs: Sequence[Path], argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it is *born* in the cgroups whose ``cgroup.procs`` files
    are ``procs`` (entered before the command starts: no window in which a kill of the
    caller's unit reaches it); ``argv`` itself when ``procs`` is empty."""
    if not procs:
        return list(argv)
    return ["sh", "-c", ENTER_THEN_EXEC, "sh", *(str(p) for p in procs), "--", *argv]
