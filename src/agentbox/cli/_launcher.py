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

from typing import Literal

import typer
from rich.console import Console

from agentbox.config import load_settings
from agentbox.errors import RefusedError

__all__ = ["register"]

_err = Console(stderr=True)


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
        from agentbox.launcher import stop_launcher

        mode: Literal["leave", "drain", "cancel"] = (
            "drain" if drain else "cancel" if cancel else "leave"
        )
        settings = load_settings()
        pid = stop_launcher(settings.data_dir, mode, timeout=timeout)
        _err.print(f"launcher (pid {pid}) stopped ({mode})")
