"""The pool's slots on disk: directories, records, the lock, and their mounts (the
pool dir shared with itself, a slot's binds made and undone).

``os.path.ismount`` misses a bind mount of the same filesystem (the pool dir over
itself, a gateway dir): :func:`~agentbox.linux.mounts.is_mount` reads ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends.podman._pool_disk import drop as drop_disk
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError
from agentbox.linux.mounts import (
    MS_BIND,
    MS_MOVE,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_RELATIME,
    MS_REMOUNT,
    is_mount,
    mount,
    umount,
    umount_lazy,
)

#: Pool sandboxes are named ``agentbox-pool-<hex>`` until claimed.
SLOT_PREFIX = "agentbox-pool-"

log = get_logger(__name__)


def bind(source: Path, target: Path, opts: str, *, stage: Path) -> None:
    """Bind ``source`` on ``target`` with ``opts`` already set when it appears there.

    A remount's flags do not propagate: the copy the sandbox receives keeps the flags
    the mount had when it came. So the bind is made and remounted in ``stage`` (a
    private place, empty dir made here), then moved onto ``target`` in one step.

    The ``mount(2)`` calls ``mount --bind``, ``mount -o remount,bind,OPTS`` and
    ``mount --move`` make (util-linux 2.38: the remount keeps the bind's own flags,
    read back, and adds ``opts``), made here: three ``mount`` processes were ~15 ms
    of every pool claim, on the path of the task's start.
    """
    extra = 0
    for opt in opts.split(","):
        if opt not in _MS_OPTS:
            raise ValueError(f"bind option {opt!r} not one of {sorted(_MS_OPTS)}")
        extra |= _MS_OPTS[opt]
    stage.mkdir(mode=0o700)
    try:
        mount(source, stage, MS_BIND)
        try:
            have = os.statvfs(stage).f_flag
            kept = sum(ms for st, ms in _ST_TO_MS if have & st)
            mount(None, stage, MS_REMOUNT | MS_BIND | kept | extra)
            mount(stage, target, MS_MOVE)
        except BaseException:
            with contextlib.suppress(OSError):
                umount_lazy(stage)
            raise
    finally:
        with contextlib.suppress(OSError):
            stage.rmdir()


_MS_OPTS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
#: ``statvfs`` flags (``ST_*``) of a mount and the ``MS_*`` flags a remount keeps them by.
_ST_TO_MS = (
    (os.ST_RDONLY, MS_RDONLY),
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)


def unbind(sdir: Path) -> None:
    """Unmount a slot's binds (``umount``, then ``umount --lazy`` if still there), by
    ``umount2`` in this process: two ``umount`` processes were ~10-25 ms of every
    claimed task's end, on the path to its result."""
    for m in (sdir / "ws", sdir / "gw"):
        for how in (umount, umount_lazy):
            if not is_mount(m):
                break
            try:
                how(m)
            except OSError as exc:
                log.debug("pool slot unmount failed", path=str(m), error=str(exc))


def slot_log(root: Path, slot: str) -> Path:
    """The log conmon writes for ``slot``: in the data dir beside the pool dir (a mount
    of its own), so that a task's log in the data dir can be a hard link of it."""
    logs = root.parent / "pool-logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    return logs / f"{slot}.log"


def discard(sdir: Path) -> None:
    """Unmount a slot's binds, then remove it (never through a mount left over)."""
    log_file = slot_log(sdir.parent.parent, sdir.name)
    for f in (log_file, log_file.with_name(log_file.name + ".tmp")):
        f.unlink(missing_ok=True)
    drop_disk(sdir.parent.parent.parent, sdir.name)  # its staged workspace disk, unclaimed
    unbind(sdir)
    if any(is_mount(m) for m in (sdir / "ws", sdir / "gw")):
        log.error("a pool slot's mount would not go; slot kept", slot=sdir.name)
        return
    shutil.rmtree(sdir, ignore_errors=True)


def share(root: Path) -> None:
    """Make the pool dir a shared mount of itself: what the host mounts in a slot then
    reaches the sandbox's ``rslave`` bind of it.

    The pool dir is root's, 0700: a slot's ``ws`` holds the claim's go-file (the task's
    argv with its text, and its gateway token) until the workspace is bound over it,
    then the task's workspace; no other local user may look in. A
    sandbox reaches its slot through its own bind mounts, never through this path."""
    (root / "slots").mkdir(parents=True, exist_ok=True, mode=0o700)
    root.chmod(0o700)
    (root / "slots").chmod(0o700)
    if not is_mount(root):
        _proc.run(["mount", "--bind", root, root], timeout=60)
    _proc.run(["mount", "--make-shared", root], timeout=60)


def unmount_if_empty(root: Path) -> bool:
    """Unmount the pool dir's bind of itself once no slot is left; True if it went."""
    try:
        if any((root / "slots").iterdir()):
            return False
    except FileNotFoundError:
        pass
    if not is_mount(root):
        return False
    with contextlib.suppress(AgentboxError):
        _proc.run(["umount", root], timeout=60)
    return not is_mount(root)


def pool_dir(settings: Settings) -> Path:
    """``data_dir/pool``: the slots and the claim records (a shared mount of itself)."""
    return settings.data_dir / "pool"


#: A fill or a claim takes well under a second (a claim's ``podman rename`` is given
#: 60 s); a slot whose last change is older than this, and whose container still has
#: the slot's name, was cut short by its process's death.
UNDER_WAY = 120.0


def pool_holds(settings: Settings, name: str) -> bool:
    """Whether the warm pool, not the orphan sweep, answers for container ``name``: an
    unclaimed entry (the pool's own sweep tells a live keeper's from a dead one's), or
    a slot being filled or claimed right now (its container is renamed to the task's at
    the end of a claim). An older claimed or half-filled slot is an orphan's."""
    if not name.startswith(SLOT_PREFIX) or "/" in name:
        return False
    sdir = pool_dir(settings) / "slots" / name
    try:
        if (sdir / "ready").exists():
            return True
        return time.time() - sdir.stat().st_mtime < UNDER_WAY
    except OSError:
        return False


def slots(root: Path) -> Iterator[tuple[Path, dict[str, Any] | None]]:
    base = root / "slots"
    if not base.is_dir():
        return
    for sdir in sorted(base.iterdir()):
        if not sdir.name.startswith(SLOT_PREFIX) or sdir.is_symlink() or not sdir.is_dir():
            continue
        try:
            rec = json.loads((sdir / "ready").read_text())
        except (OSError, ValueError):
            rec = None
        yield sdir, rec if isinstance(rec, dict) else None


def filler() -> dict[str, Any]:
    """This process, as the filler a ready record names (see :func:`filler_alive`)."""
    me = psutil.Process()
    return {"filler": me.pid, "filler_start": me.create_time()}


def filler_alive(ready: dict[str, Any]) -> bool:
    """Whether the process that filled the entry (a launcher's keeper) still runs; a
    record without one (an older version's) counts as a dead filler's."""
    try:
        proc = psutil.Process(int(ready.get("filler", 0)))
        return (
            abs(proc.create_time() - float(ready.get("filler_start", 0))) < 0.01
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.Error, ValueError, TypeError):
        return False


def alive(ready: dict[str, Any]) -> bool:
    try:
        proc = psutil.Process(int(ready.get("conmon", 0)))
        return (
            proc.name() == "conmon"
            and abs(proc.create_time() - float(ready.get("conmon_start", 0))) < 0.01
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.Error, ValueError, TypeError):
        return False


def write(path: Path, data: dict[str, Any], *, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(data))
    tmp.chmod(mode)
    tmp.replace(path)


@contextlib.contextmanager
def locked(settings: Settings) -> Iterator[Path]:
    """One filler or sweeper at a time per data dir (claims do not take it)."""
    root = pool_dir(settings)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(settings.data_dir / "pool.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield root
    finally:
        os.close(fd)
