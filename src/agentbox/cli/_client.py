"""How a task command reaches tasks: the in-process launcher, or the launcher service.

* :func:`in_process`: a :class:`~agentbox.launcher.Launcher` in this process (the
  CLI runs as root, like the launcher). It reads and writes the same SQLite state
  as every launcher on this host, so ``show``, ``tasks`` and ``cancel`` work on
  tasks of any of them; a task it *submits* runs in this process (``run``).
* :func:`ensure_service`: a client of ``agentbox launcher serve`` on
  ``<data_dir>/run/launcher.sock``, started on demand (detached, in its own
  session, logging to ``<data_dir>/launcher.log``) when none answers. Tasks
  submitted there outlive this process (``run --detach``, ``resume --detach``).
* :class:`Riding`: a client that rides through a launcher restart: while the
  socket is gone or refuses, it says so once ("launcher restarting…") and retries
  with backoff, for up to ``window`` seconds; as root, after 10 s without an answer
  it starts the launcher service itself (nothing may be restarting it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentbox.config import Settings, load_settings
from agentbox.core.log import get_logger
from agentbox.core.wait import socket_accepts, wait_until
from agentbox.errors import AgentboxError, TaskError

if TYPE_CHECKING:
    from agentbox.launcher.client import LauncherClient

log = get_logger(__name__)

#: The on-demand launcher service's log, in the data dir.
SERVICE_LOG = "launcher.log"
#: Seconds a command waits for a launcher that went away to answer again.
RESTART_WINDOW = 300.0
#: Seconds an on-demand launcher has to start answering.
START_TIMEOUT = 60.0
#: Seconds without an answer after which root starts the launcher service itself.
START_AFTER = 10.0
#: The client's own silent reconnect, kept short: :class:`Riding` retries on and says so.
RECONNECT = 1.0

_T = TypeVar("_T")
#: Told what a command does on its own (a launcher started, a restart waited out).
Say = Callable[[str], object]


def in_process(max_tasks: int = 4, settings: Settings | None = None) -> Any:
    """A launcher in this process (imported lazily: it pulls in the backends)."""
    from agentbox.launcher import Launcher

    return Launcher(settings or load_settings(), max_tasks=max_tasks)


def service_socket(settings: Settings) -> Path:
    """Where the launcher service listens for this data dir."""
    from agentbox.launcher import socket_path

    path: Path = socket_path(settings.data_dir)
    return path


def ensure_service(settings: Settings, *, say: Say) -> LauncherClient:
    """A client of the launcher service, starting one (detached) when none answers.

    ``say`` is told what was started, and where it logs. Another launcher that wins
    a race to start is as good as ours: what counts is that the socket answers.
    """
    path = service_socket(settings)
    if socket_accepts(path):
        return _client(path)
    logfile = settings.data_dir / SERVICE_LOG
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)  # fmt: skip
    try:
        # A daemon, not a child we supervise: its own session (a closed terminal or a
        # Ctrl-C here never reaches it), no stdin, output to its log. Not through
        # agentbox.core.proc, whose calls wait for the command to end.
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    finally:
        os.close(fd)
    log.info("launcher service started", pid=proc.pid, log=str(logfile))

    def answers() -> bool:
        if socket_accepts(path):
            return True
        if proc.poll() is not None and not socket_accepts(path):
            raise TaskError(
                f"the launcher service exited ({proc.returncode}) before it answered; "
                f"see {logfile}: {_tail(logfile)}"
            )
        return False

    wait_until(
        answers,
        timeout=START_TIMEOUT,
        interval=0.1,
        on_timeout=lambda: TaskError(
            f"the launcher service (pid {proc.pid}) did not answer on {path} within "
            f"{START_TIMEOUT:g}s; see {logfile}"
        ),
    )
    if proc.poll() is None:
        say(f"started the launcher service (pid {proc.pid}; log {logfile})")
    return _client(path)


def _tail(path: Path, limit: int = 600) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return "(no log)"
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(empty log)"


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is the launcher being away (no socket, refused, dropped)."""
    httpx = sys.modules.get("httpx")  # not imported: no client made the call
    return (
        httpx is not None
        and isinstance(exc, TaskError)
        and isinstance(exc.__cause__, httpx.TransportError)
    )


def _client(path: Path) -> LauncherClient:
    """A client of the launcher service at ``path`` (httpx: imported here, on use)."""
    from agentbox.launcher.client import LauncherClient

    return LauncherClient(path, timeout=60.0, reconnect=RECONNECT)


class Riding:
    """Calls on a launcher client that ride through a restart of the launcher.

    While the launcher does not answer, ``say`` is told once ("launcher restarting…")
    and the call is retried with backoff (0.2 s doubling to 3 s), for up to
    ``window`` seconds without an answer; then the last error is raised.
    """

    def __init__(
        self,
        client: LauncherClient,
        *,
        say: Say,
        window: float = RESTART_WINDOW,
        restart: Callable[[], object] | None = None,
    ) -> None:
        self.client = client
        self.say = say
        self.window = window
        self.restart = restart
        """Called once after :data:`START_AFTER` seconds without an answer (root: start the
        launcher service on demand, should nothing restart it)."""
        self._away_since: float | None = None
        self._restarted = False

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        delay = 0.2
        while True:
            try:
                result = fn(*args, **kwargs)
            except AgentboxError as exc:
                if not unreachable(exc):
                    raise
                now = time.monotonic()
                if self._away_since is None:
                    self._away_since = now
                    self.say("launcher restarting… (waiting for it to answer again)")
                if now - self._away_since > self.window:
                    raise
                late = now - self._away_since > START_AFTER
                if self.restart is not None and not self._restarted and late:
                    self._restarted = True
                    with contextlib.suppress(AgentboxError):
                        self.restart()  # a launcher that wins the race is as good
                time.sleep(delay)
                delay = min(delay * 2, 3.0)
                continue
            if self._away_since is not None:
                self._away_since = None
                self._restarted = False
                self.say("launcher back")
            return result


class Tasks:
    """Where ``wait``, ``watch`` and ``show`` read a task from, so that its state converges.

    The launcher service when one answers (riding through its restarts); else, as
    root, the state database in this process. A task read there that is not finished
    but whose launcher is gone (a ``run`` killed with SIGKILL, say) would never move
    again: the launcher service is started then, on demand, and takes it over (a
    starting launcher re-adopts every task whose owner died, or settles it), and the
    reads go there from then on.
    """

    def __init__(self, settings: Settings, *, say: Say) -> None:
        self.settings = settings
        self.say = say
        self.riding: Riding | None = None
        self.local: Any = None
        path = service_socket(settings)
        if socket_accepts(path):
            self.riding = self._riding(_client(path))
        elif os.geteuid() == 0:
            self.local = in_process(1, settings)
        else:
            self.riding = self._riding(ensure_service(settings, say=say))

    def _riding(self, client: LauncherClient) -> Riding:
        if os.geteuid() != 0:
            return Riding(client, say=self.say)
        # Root may start the launcher service itself when nothing restarts it.
        return Riding(
            client,
            say=self.say,
            restart=lambda: ensure_service(self.settings, say=self.say).close(),
        )

    def _service(self) -> Riding:
        if self.riding is None:
            self.riding = self._riding(ensure_service(self.settings, say=self.say))
            if self.local is not None:
                self.local.close(wait=False)
                self.local = None
        return self.riding

    def orphaned(self, task_id: str) -> bool:
        """True when the task is unfinished and no live process owns it (read locally)."""
        if self.local is None:
            return False
        row = self.local.store.get(task_id)
        if row.status in ("done", "failed", "timed_out", "cancelled"):
            return False
        return row.owner is None or not row.owner.alive()

    def get(self, task_id: str) -> Any:
        if self.local is not None:
            if not self.orphaned(task_id):
                return self.local.get(task_id)
            self.say(f"task {task_id}'s launcher is gone; the launcher service takes it over")
        return self._service().call(self._service().client.get, task_id)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Any other launcher call (``result``, ``transcript``, ``cancel``) by name."""
        if self.local is not None:
            return getattr(self.local, name)(*args, **kwargs)
        riding = self._service()
        return riding.call(getattr(riding.client, name), *args, **kwargs)

    def close(self) -> None:
        if self.local is not None:
            self.local.close(wait=False)
        if self.riding is not None:
            self.riding.client.close()
