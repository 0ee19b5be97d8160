"""Killing a sandbox's owner never leaves the sandbox running.

Two halves, used by ``agentbox exec``, ``agentbox shell`` and the in-process
``agentbox run``:

* :func:`exit_on_signals`: every catchable signal that would end the process
  (TERM from CI timeouts and systemd, HUP from a closed terminal, INT, QUIT, …)
  becomes a :class:`Terminated` exception in the main thread, so the ``finally``
  blocks and context managers that destroy sandboxes run before the process
  ends. Once out of the block the process ends *by that signal*, as it would
  have without us (its parent sees the same wait status). Further signals
  during the cleanup are ignored: the cleanup is what must not be cut short.
  A signal already set to be ignored (``nohup``) stays ignored.
* :func:`guarded`: for what no handler can catch (SIGKILL, the OOM killer, a
  crash), a watchdog process (:mod:`agentbox.launcher._watchdog`) waits on the
  owner's pidfd and reaps the sandbox the moment the owner dies, without
  waiting for a launcher to start. It also kills the sandbox at its deadline
  plus a grace, should the backend's own deadline fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from agentbox.core.log import get_logger

__all__ = ["END_SIGNALS", "GUARD_GRACE", "Terminated", "exit_on_signals", "guarded"]

log = get_logger(__name__)

#: The catchable signals whose default action ends the process. SIGPIPE and SIGXFSZ
#: are not here: Python ignores them and turns them into exceptions already.
END_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
    signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXCPU,
    signal.SIGIO, signal.SIGPWR,
)  # fmt: skip

#: Seconds past a sandbox's deadline after which its watchdog kills it (the backend's
#: own deadline fires first; this is the second line).
GUARD_GRACE = 120.0


class Terminated(KeyboardInterrupt):
    """A signal asked this process to end (raised in the main thread).

    A :class:`KeyboardInterrupt`, so every path that already cleans up after
    Ctrl-C (``agentbox run`` cancels its task and collects) does the same for
    TERM or HUP.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def _die_by(signum: int) -> None:
    """End this process by ``signum`` with its default action (flushing stdio first)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    # SIGINT/SIGQUIT may be ignored by the parent's choice; then just exit as shells do.
    os._exit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Run the block with :data:`END_SIGNALS` raising :class:`Terminated`.

    If a :class:`Terminated` leaves the block, the process then ends by that
    signal. A block that catches it (``run`` cancelling its task) chooses its own
    exit. Outside the main thread this does nothing (Python runs handlers there only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if got:
            log.warning("signal ignored: still cleaning up", signal=signum)
            return
        got.append(signum)
        raise Terminated(signum)

    old: dict[signal.Signals, object] = {}
    for sig in END_SIGNALS:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    except Terminated as exc:
        for sig, previous in old.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        _die_by(exc.signum)
        raise  # pragma: no cover  (_die_by does not return)
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]


@contextlib.contextmanager
def guarded(
    backend: str,
    sandbox: str,
    deadline: float,
    data_dir: Path,
    *,
    scratch: Path | None = None,
) -> Iterator[None]:
    """Run the block with a watchdog that reaps ``sandbox`` if this process dies.

    Start it *before* the sandbox exists (a reap of nothing is harmless) so no
    window is left uncovered. On a clean exit from the block the watchdog is
    stopped; on an exception it is left running, so that once this process has
    ended it sweeps whatever the unwinding could not remove. ``scratch`` is a
    throw-away workspace the watchdog removes after a reap.
    """
    from agentbox.launcher import spawn_watchdog

    run_dir = data_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    proc = spawn_watchdog(
        backend=backend,
        sandbox=sandbox,
        data_dir=data_dir,
        at=time.time() + deadline + GUARD_GRACE,
        gateway_pid=None,
        gateway_start=None,
        log_file=run_dir / "watchdog.log",
        scratch=scratch,
    )
    yield
    proc.terminate()
    with contextlib.suppress(Exception):
        proc.wait(5)
