"""Start and keep the front end's fork server (:mod:`agentbox.front`) beside
``agentbox launcher serve``.

The server (:mod:`agentbox.front.server`) is a child process in a session of its
own (a Ctrl-C meant for a launcher run in a terminal is not its), with the
launcher's pid to watch: it exits when the launcher does, even after a SIGKILL.
It is started again when it exits (an upgrade found, a crash); three exits within
:data:`QUICK` seconds of their starts stop that, with an error logged: the commands
then run in their callers' processes, as without a front end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from agentbox.core.frontend import SOCKET_NAME, mode
from agentbox.core.log import get_logger

log = get_logger(__name__)

#: Seconds between the service's start and the server's: its imports (~1.5 s of CPU)
#: then neither slow the service's own start (reconcile, adoption) nor are paid by a
#: service that dies or restarts at once (a restart loop, a chaos kill). Commands in
#: the meantime run in their own processes, as without a front end.
START_DELAY = 3.0
#: A server that exits sooner than this after its start counts as a failed start.
QUICK = 10.0
MAX_QUICK_EXITS = 3


class FrontKeeper:
    """The fork server for ``data_dir``, listening in ``run_dir``, kept running."""

    def __init__(self, data_dir: Path, run_dir: Path) -> None:
        self.data_dir, self.socket = data_dir, run_dir / SOCKET_NAME
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._keep, name="agentbox-front", daemon=True)

    def start(self) -> FrontKeeper:
        self._thread.start()
        return self

    def _spawn(self) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "agentbox.front.server", "--socket", str(self.socket)]
        argv += ["--data-dir", str(self.data_dir), "--parent", str(os.getpid())]
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
        )

    def _keep(self) -> None:
        quick = 0
        if self._stopping.wait(START_DELAY):
            return
        while not self._stopping.is_set():
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    proc = self._proc = self._spawn()
                except OSError as exc:
                    log.error("front end not started", error=str(exc))
                    return
            started = time.monotonic()
            log.info("front end started", pid=proc.pid, socket=str(self.socket))
            code = proc.wait()
            if self._stopping.is_set():
                return
            quick = quick + 1 if time.monotonic() - started < QUICK else 0
            log.info("front end exited; starting it again", code=code, pid=proc.pid)
            if quick >= MAX_QUICK_EXITS:
                log.error(
                    "front end keeps exiting; commands run in their own processes",
                    code=code,
                    exits=quick,
                )
                return

    def stop(self) -> None:
        """Stop the server (its commands run on: each is its caller's) and its socket."""
        with self._lock:
            self._stopping.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            if self.socket.is_socket():
                self.socket.unlink()


def start_front(data_dir: Path, run_dir: Path) -> FrontKeeper | None:
    """A kept fork server, unless ``AGENTBOX_FRONT_END=off``."""
    if mode() == "off":
        return None
    return FrontKeeper(data_dir, run_dir).start()
