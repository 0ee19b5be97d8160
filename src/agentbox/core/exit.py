"""End a process that has finished its work without the interpreter's teardown.

Python's own exit frees every module's objects one by one: 0.2-0.4 s of CPU for a
process that imported pydantic, rich and the backends (measured: the gateway after
its last usage write, ``agentbox run`` after printing its result), with nothing left
to do. :func:`end_process` does what a normal exit does that matters (waits for
non-daemon threads, runs the exit handlers, flushes logging and the standard
streams) and then ends the process with ``os._exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

__all__ = ["announce_exit_to", "end_process", "exit_code"]

#: (pid, fd): the process that, at :func:`end_process`, tells its status on ``fd``.
_announce: tuple[int, int] | None = None


def exit_code(exc: SystemExit) -> int:
    """The status a ``SystemExit`` ends the process with (a message goes to stderr: 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def announce_exit_to(fd: int) -> None:
    """Have :func:`end_process` of this process tell its status on ``fd`` (one byte), once
    its work is done and its standard streams are flushed and let go: a served command
    (:mod:`agentbox.front`) whose waiter then answers the client at once, not after the
    kernel has torn the process down (its memory: 5-10 ms of a forked front end's on the
    path to the client's exit). A fork of this process does not announce (pid checked)."""
    global _announce
    _announce = (os.getpid(), fd)


def _let_go_of_stdio() -> None:
    """The standard streams onto ``/dev/null``: the caller's terminal or pipes are no
    longer held by this process (a reader of its output sees the end now)."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in (0, 1, 2):
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    finally:
        os.close(null)


def end_process(code: int = 0) -> NoReturn:
    """Wait for non-daemon threads, run the exit handlers, flush, and ``os._exit(code)``
    (first telling a waiter the status, if :func:`announce_exit_to` asked for it)."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t is not threading.main_thread():
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if _announce is not None and _announce[0] == os.getpid():
        with contextlib.suppress(OSError):
            _let_go_of_stdio()
            os.write(_announce[1], bytes([code & 0xFF]))
    os._exit(code)
