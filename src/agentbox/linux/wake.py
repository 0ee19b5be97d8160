"""Waking the moment something ends, instead of polling for it: a process's exit (its
pidfd) or a file appearing in a directory (inotify), whichever comes first.

A follower does not sleep a fixed interval between looks (each a ``podman
inspect``); each wait here returns as soon as either event happens, or at the
timeout the caller still needs for its own periodic work (reading output,
checking a deadline). Nothing is read from the events but "look again": the
caller checks what it waits for itself, so a missed or spurious event costs at
most one timeout, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.linux.libc import libc as load_libc

log = get_logger(__name__)

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


class Wake:
    """``wait(timeout)`` returns when process ``pid`` exits, when an entry is created,
    written or renamed into ``directory``, or after ``timeout`` seconds.

    Either source may be missing (no pid, no directory, or the kernel refusing an
    inotify instance: root's quota is shared with every sandbox's user namespace):
    then that source never wakes it and the timeout stands in for it.
    """

    def __init__(self, pid: int | None = None, directory: Path | None = None) -> None:
        self._fds: list[int] = []
        self._inotify: int | None = None
        self._poller = select.poll()
        if pid is not None and pid > 0:
            with contextlib.suppress(OSError):
                self._add(os.pidfd_open(pid))
        if directory is not None:
            self._inotify = _watch(directory)
            if self._inotify is not None:
                self._add(self._inotify)

    def _add(self, fd: int) -> None:
        self._fds.append(fd)
        self._poller.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True if an event (not the timeout) woke it."""
        events = self._poller.poll(max(0, int(timeout * 1000)))
        if self._inotify is not None and any(fd == self._inotify for fd, _ in events):
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._inotify, 4096):  # drained: only "look again" matters
                    pass
        return bool(events)

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._inotify = None

    def __enter__(self) -> Wake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _watch(directory: Path) -> int | None:
    """An inotify fd watching ``directory`` for new or rewritten entries; None if refused."""
    libc = load_libc()
    fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
    if fd < 0:
        log.info(
            "no inotify instance; waking on the timeout", error=os.strerror(ctypes.get_errno())
        )
        return None
    mask = _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE
    if int(libc.inotify_add_watch(fd, os.fsencode(directory), mask)) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        log.info("cannot watch a directory", path=str(directory), error=os.strerror(err))
        return None
    return fd
