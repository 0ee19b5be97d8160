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
ours), so conmon is **born** outside them: :func:`born_outside` wraps the
``podman run -d`` argv in a tiny ``sh`` that writes its own pid into
``libpod_parent/conmon/cgroup.procs`` of those two hierarchies and only
then runs ``exec podman``: podman, and the conmon it forks, start there. That is
race-free where a move after the start is not: a launcher killed between
``podman run -d`` returning and a move would leave conmon in the unit, and the
unit's next kill would kill it. (A move of the child by the parent between fork
and exec needs ``preexec_fn``, unsafe in a threaded launcher; ``posix_spawn`` has
no hook there.) :func:`place_conmon` stays as a second line, after the start and
whenever a follower or an adopter looks at conmon. Where the caller sits at a
hierarchy's root (no unit), nothing moves. The v1 *controller* hierarchies are
left to podman (a ``cpuset`` cgroup made by us would have no cpus or mems).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.linux.cgroups import ENTER_THEN_EXEC, UNIT_KEYS, cgroups_of, enter_then_exec
from agentbox.linux.cgroups import cgroup_mounts as _cgroup_mounts

logger = get_logger(__name__)

#: The shell step of :func:`born_outside` (shared with the gateway's start).
_ENTER = ENTER_THEN_EXEC


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


def _conmon_homes() -> list[Path]:
    """``cgroup.procs`` of ``libpod_parent/conmon`` in each unit hierarchy where this
    process sits below the root (made if missing)."""
    mine, mounts = cgroups_of("self"), _cgroup_mounts()
    homes = []
    for key in UNIT_KEYS:
        path = mine.get(key)
        if path in (None, "", "/") or key not in mounts:
            continue
        target = mounts[key] / "libpod_parent" / "conmon"
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("no cgroup to start conmon in", hierarchy=key, error=str(exc))
            continue
        homes.append(target / "cgroup.procs")
    return homes


def born_outside(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it (and conmon, which podman forks) starts outside this
    process's unit cgroups; ``argv`` itself where there is no unit to leave."""
    return enter_then_exec(_conmon_homes(), argv)
