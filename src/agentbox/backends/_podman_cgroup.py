"""Where a detached sandbox's conmon lives in the cgroup trees (a launcher restart
must not reach it).

Measured on our hosts (Debian 12, cgroup v1/hybrid, podman 4.3 with the cgroupfs
manager): podman moves conmon out of its caller's cgroup in every v1 *controller*
hierarchy (to ``/libpod_parent/conmon``) but leaves it in the caller's
``name=systemd`` and unified (``0::``) cgroups, the two by which systemd tracks a
unit. ``systemctl restart`` of the launcher's unit (``KillMode=control-group``)
would then kill conmon: the container would run on unmonitored, with no exit
code recorded and no ``--timeout``. ``podman run --cgroups`` offers nothing
better (``split`` needs the systemd manager; ``no-conmon`` leaves it in all of
ours), so :func:`place_conmon` moves it into ``libpod_parent/conmon`` of those
hierarchies as well, right after the start. Where the caller sits at a
hierarchy's root (no unit), nothing moves.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from agentbox._log import get_logger

__all__ = ["cgroups_of", "place_conmon"]

logger = get_logger("podman.cgroup")


def _cgroup_mounts() -> dict[str, Path]:
    """Hierarchy key (``0`` for cgroup2, else its controllers or ``name=…``) → mount point."""
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
            opts = [o for o in tail[2].split(",") if o not in ("rw", "ro", "relatime")]
            for o in opts:
                found.setdefault(o, Path(fields[4]))
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


def place_conmon(pid: int) -> list[str]:
    """Move conmon ``pid`` out of every cgroup it shares with this process (below the
    root) into ``libpod_parent/conmon`` of that hierarchy; return the hierarchies moved.

    On a v1/hybrid host under the cgroupfs manager, podman leaves conmon in its
    caller's ``name=systemd`` and unified cgroups: a unit restart would kill it.
    """
    mine, its, mounts = cgroups_of("self"), cgroups_of(pid), _cgroup_mounts()
    moved = []
    for key, path in its.items():
        if path in ("", "/") or mine.get(key) != path or key not in mounts:
            continue
        target = mounts[key] / "libpod_parent" / "conmon"
        try:
            target.mkdir(parents=True, exist_ok=True)
            (target / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            logger.warning(
                "could not move conmon out of our cgroup", pid=pid, hierarchy=key, error=str(exc)
            )
            continue
        moved.append(key)
    if moved:
        logger.debug("conmon moved out of the caller's cgroups", pid=pid, hierarchies=moved)
    return moved
