"""conmon's exit file: the first word of a detached sandbox's end.

conmon writes the container's exit status to ``<exit-dir>/<container id>`` the
moment the container's init exits, then runs podman's exit command (``podman
container cleanup``: unmounting the rootfs, updating podman's database) and only
*then* exits itself: 0.3 to 0.8 s later on a busy 2-core host. A follower that waits
for conmon to go, then asks ``podman inspect`` (which waits on the same container
lock as that cleanup), learns the end that much later than it could. The file is
root's (``/run/libpod/exits``, written by conmon, never reachable from the
sandbox) and holds the exit code alone; its mtime is the end.

When the file is there the sandbox's processes are gone: the container runs in its
own PID namespace, whose init is the agent's relay, and the kernel kills and reaps
every process of a namespace before its init's exit reaches conmon.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import stat
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends.base import Exited
from agentbox.backends.oci._cli import kill
from agentbox.core.log import get_logger

logger = get_logger(__name__)

#: How long a follower waits for conmon to go after the container is removed.
CONMON_EXIT_WAIT = 15.0

_ID = re.compile(r"[0-9a-f]{64}")


def exit_file_of(conmon: psutil.Process | None, info: Mapping[str, Any]) -> Path | None:
    """Where ``conmon`` writes the inspected container's exit status, or None when
    that is not known for sure (no conmon, no ``--exit-dir``, an id or a directory that
    is not what it should be: a root-owned directory no one else may write)."""
    cid = info.get("Id")
    if conmon is None or not isinstance(cid, str) or not _ID.fullmatch(cid):
        return None
    try:
        argv = conmon.cmdline()
    except psutil.Error:
        return None
    try:
        exit_dir = Path(argv[argv.index("--exit-dir") + 1])
    except (ValueError, IndexError):
        return None
    if not exit_dir.is_absolute():
        return None
    try:
        st = exit_dir.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return None
    return exit_dir / cid


def read_owned_note(path: Path, *, uid: int, limit: int) -> tuple[str, os.stat_result] | None:
    """The text (ascii, stripped) and stat of a small file podman's side wrote, only if
    it is a regular file (no link followed, no FIFO waited on) owned by ``uid`` and at
    most ``limit`` bytes; None otherwise or when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size > limit:
            return None
        return os.read(fd, limit).decode("ascii", "replace").strip(), st
    except OSError:
        return None
    finally:
        os.close(fd)


def read_exit_file(path: Path | None) -> tuple[int, float] | None:
    """(exit code, when) from conmon's exit file; None while there is none (or it is
    not yet a whole number: conmon writes it once, so a later look sees it whole)."""
    if path is None or (note := read_owned_note(path, uid=0, limit=64)) is None:
        return None
    text, st = note
    if not re.fullmatch(r"-?\d{1,4}", text):
        return None
    return int(text), st.st_mtime


def _ended(code: int, finished: float, started: float, deadline: float, *, killed: bool) -> Exited:
    """How the sandbox ended, from its exit code and time. conmon's --timeout SIGKILLs
    the sandbox and leaves no exit status: podman then reports -1. Past the deadline
    that is our kill, reported as run() reports one."""
    timed_out = killed or (code in (-1, 137, 255) and finished - started >= deadline)
    return Exited(137 if timed_out and code == -1 else code, timed_out)


def _end_orphan(name: str, info: Mapping[str, Any]) -> None:
    """The sandbox's conmon is gone but podman says it runs: if its process lives, it
    runs unmonitored (no output recorded, no exit code, no ``--timeout``): kill it
    now (its deadline at the latest) and wait (bounded) for its process to go."""
    pid = _state(info).get("Pid")
    proc = None
    with contextlib.suppress(psutil.Error, TypeError, ValueError):
        proc = psutil.Process(int(pid)) if isinstance(pid, int) and pid > 0 else None
    if proc is not None and _running(proc):
        logger.warning(
            "sandbox orphaned: its conmon is gone, its process runs; killing it",
            sandbox=name,
            pid=proc.pid,
        )
        kill(name)
        wait_exited(proc, CONMON_EXIT_WAIT)
    else:
        logger.warning(
            "sandbox ended with its conmon gone: its exit code is unknown (-1)", sandbox=name
        )


def _state(info: Mapping[str, Any]) -> Mapping[str, Any]:
    state = info.get("State")
    return state if isinstance(state, dict) else {}


_FRACTION = re.compile(r"\.(\d{1,9})")


def _when(stamp: object) -> float | None:
    """Seconds since the epoch of podman's RFC 3339 time (nanoseconds cut to micro)."""
    if not isinstance(stamp, str) or stamp.startswith("0001-"):
        return None
    text = _FRACTION.sub(lambda m: "." + m.group(1)[:6].ljust(6, "0"), stamp, count=1)
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def wait_exited(proc: psutil.Process, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit; True once it has.

    Exited, not reaped: a conmon's parent is the host's init (it double-forks), and
    an init that reaps orphans late (a sandbox host's own agent as PID 1 took 1.6 to
    2.0 s here) kept ``psutil.Process.wait``, which waits for the pid to disappear,
    blocked that long after conmon had finished podman's cleanup and exited. Its
    pidfd is readable the moment it exits. Opened first, checked second: a pid
    reused after the check cannot be waited on by mistake.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # gone (reaped), or no pidfds: nothing left to wait for
        return not _running(proc)
    try:
        if not _running(proc):  # a zombie already, or the pid is another process's now
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
