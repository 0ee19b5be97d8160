"""``agentbox launcher serve`` and ``agentbox launcher stop [--drain | --cancel]``.

``serve`` is the long-lived privileged daemon that service managers (and chaos kills)
restart, so this module imports nothing at the top beyond typer: a restart pays for
the launcher itself, not for the MCP server, httpx's client or rich tables.

``stop`` stops the launcher serving this data dir.

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


def _say(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(message)


def register(app: typer.Typer) -> None:
    """Add the ``agentbox launcher`` group (``serve``, ``stop``) to ``app``."""
    group = typer.Typer(help="The privileged launcher service.", no_args_is_help=True)
    app.add_typer(group, name="launcher")

    @group.command("serve")
    def serve(
        max_tasks: int = typer.Option(4, "--max-tasks", min=1, max=64),
        metrics: str | None = typer.Option(
            None,
            "--metrics",
            metavar="127.0.0.1:PORT",
            help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics (loopback only).",
        ),
    ) -> None:
        """Serve the launcher's API on <data_dir>/launcher.sock (used by the MCP server)."""
        from agentbox.config import load_settings
        from agentbox.launcher import Launcher
        from agentbox.launcher import serve as _serve

        settings = load_settings()
        exporter = None
        if metrics is not None:
            from agentbox.launcher.metrics import MetricsServer

            exporter = MetricsServer(settings, metrics)  # a bad address fails before serving
        launcher = Launcher(settings, max_tasks=max_tasks)

        def listening(path: object) -> None:
            from agentbox.launcher.metrics import note_launcher_start

            note_launcher_start(settings)
            _say(f"launcher listening on {path}")
            if exporter is not None:
                exporter.start()
                _say(f"metrics at http://{exporter.address}/metrics")

        # Announced only once bound: a refused start (another launcher) prints no address.
        try:
            _serve(launcher, on_listening=listening)
        finally:
            if exporter is not None:
                exporter.stop()

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
        from agentbox.config import load_settings
        from agentbox.errors import RefusedError

        if drain and cancel:
            raise RefusedError("--drain and --cancel exclude each other")
        from agentbox.launcher import stop_launcher

        mode: Literal["leave", "drain", "cancel"] = (
            "drain" if drain else "cancel" if cancel else "leave"
        )
        settings = load_settings()
        pid = stop_launcher(settings.data_dir, mode, timeout=timeout)
        _say(f"launcher (pid {pid}) stopped ({mode})")
