"""``agentbox ui``: the local web view of your tasks (``agentbox.ui``)."""

from __future__ import annotations

import typer


def ui(
    listen: str = typer.Option(
        "127.0.0.1:8766",
        "--listen",
        metavar="127.0.0.1:PORT",
        help="Loopback address to serve on (port 0 picks one).",
    ),
) -> None:
    """Serve a web view of your tasks on 127.0.0.1; prints its login link first."""
    from agentbox.config import load_settings
    from agentbox.ui import serve_ui

    def say(line: str) -> None:
        print(line, flush=True)

    serve_ui(load_settings(), listen, say=say)


def register(app: typer.Typer) -> None:
    """Add ``ui`` to the CLI."""
    app.command("ui")(ui)
