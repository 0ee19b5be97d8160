"""``agentbox launcher stop [--drain | --cancel]``: stop the launcher serving this data dir.

The serving launcher is found by its lock (``<data_dir>/run/launcher.lock``, which
names its pid and is ``flock``-ed for its life) and told how to stop by a signal
(:data:`agentbox.launcher._server.STOP_SIGNALS`):

* plain ``stop`` (SIGTERM, what ``systemctl stop`` sends too): running tasks go on
  detached and the next launcher re-adopts them; queued tasks wait for it;
* ``--drain`` (SIGUSR1): take no new task, finish every queued and running one, exit;
* ``--cancel`` (SIGUSR2): cancel every task (each collected as ``cancelled``), exit.

It waits until the launcher has let go of its lock (``--timeout``; 0 waits for ever).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import typer
from rich.console import Console

from agentbox.config import load_settings
from agentbox.errors import RefusedError, TaskError

__all__ = ["register", "serving_pid", "stop_launcher"]

_err = Console(stderr=True)


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


def stop_launcher(data_dir: Path, mode: str = "leave", *, timeout: float = 120.0) -> int:
    """Signal the launcher serving ``data_dir`` to stop as ``mode`` and wait until it has;
    return its pid. :class:`RefusedError` when none serves it."""
    from agentbox.launcher._server import LOCK_NAME, RUN_DIR, STOP_SIGNALS

    lock = data_dir / RUN_DIR / LOCK_NAME
    pid = serving_pid(lock)
    if pid is None or not _is_launcher(pid):
        raise RefusedError(f"no launcher serves {data_dir} (nothing holds {lock})")
    os.kill(pid, STOP_SIGNALS[mode])  # type: ignore[index]
    end = None if timeout <= 0 else time.monotonic() + timeout
    while serving_pid(lock) == pid:
        if end is not None and time.monotonic() >= end:
            raise TaskError(f"the launcher (pid {pid}) is still stopping after {timeout:g}s")
        time.sleep(0.2)
    return pid


def register(app: typer.Typer) -> None:
    """Add ``stop`` to the ``agentbox launcher`` group (made by the tasks module)."""
    group = next((g.typer_instance for g in app.registered_groups if g.name == "launcher"), None)
    if group is None:  # the tasks module did not register the group: make it
        group = typer.Typer(help="The privileged launcher service.", no_args_is_help=True)
        app.add_typer(group, name="launcher")

    @group.command("stop")
    def stop(
        drain: bool = typer.Option(
            False, "--drain", help="Take no new task; wait for every queued and running one."
        ),
        cancel: bool = typer.Option(
            False, "--cancel", help="Cancel every task (each collected as cancelled)."
        ),
        timeout: float = typer.Option(
            0.0, "--timeout", help="Seconds to wait for the launcher to exit (0: for ever)."
        ),
    ) -> None:
        """Stop the launcher. Plain stop leaves running tasks to the next launcher."""
        if drain and cancel:
            raise RefusedError("--drain and --cancel exclude each other")
        mode = "drain" if drain else "cancel" if cancel else "leave"
        settings = load_settings()
        pid = stop_launcher(settings.data_dir, mode, timeout=timeout)
        _err.print(f"launcher (pid {pid}) stopped ({mode})")
