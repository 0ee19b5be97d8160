"""Stopping the launcher that serves a data dir, from another process (``agentbox
launcher stop``): found by its lock (``<data_dir>/run/launcher.lock``, which names its
pid and is ``flock``-ed for its life) and told how to stop by a signal
(:data:`agentbox.launcher._server.STOP_SIGNALS`)."""

from __future__ import annotations

import fcntl
import math
import os
from pathlib import Path

from agentbox.core.wait import wait_until
from agentbox.errors import RefusedError, TaskError
from agentbox.launcher._core import StopMode
from agentbox.launcher._server import LOCK_NAME, RUN_DIR, STOP_SIGNALS


def serving_pid(lock: Path) -> int | None:
    """The pid of the launcher holding ``lock``, or None when none holds it."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _is_launcher(pid: int) -> bool:
    """Whether ``pid`` runs ``… launcher serve`` (checked before it is signalled)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"launcher" in args and b"serve" in args


def stop_launcher(data_dir: Path, mode: StopMode = "leave", *, timeout: float = 120.0) -> int:
    """Signal the launcher serving ``data_dir`` to stop as ``mode`` and wait until it has;
    return its pid. :class:`RefusedError` when none serves it."""
    lock = data_dir / RUN_DIR / LOCK_NAME
    pid = serving_pid(lock)
    if pid is None or not _is_launcher(pid):
        raise RefusedError(f"no launcher serves {data_dir} (nothing holds {lock})")
    os.kill(pid, STOP_SIGNALS[mode])
    wait_until(
        lambda: serving_pid(lock) != pid,
        timeout=timeout if timeout > 0 else math.inf,
        on_timeout=lambda: TaskError(
            f"the launcher (pid {pid}) is still stopping after {timeout:g}s"
        ),
        interval=0.2,
    )
    return pid
