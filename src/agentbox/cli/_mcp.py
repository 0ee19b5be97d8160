"""``agentbox mcp`` (the MCP server, stdio or HTTP) and ``agentbox serve`` (launcher + MCP)."""

from __future__ import annotations

import os

import typer

from agentbox.config import load_settings

# The MCP SDK is imported inside the commands: at module level it would add ~0.5 s
# to every other agentbox command. Kept equal to agentbox.mcp._server.DEFAULT_MAX_PENDING
# (a unit test pins it).
DEFAULT_MAX_PENDING = 4

_USER_HELP = (
    "Run as this user (name or uid) when started as root; default: $AGENTBOX_MCP_USER, "
    "else the owner of the repos root. Never root."
)


def mcp(
    http: str | None = typer.Option(
        None,
        "--http",
        metavar="127.0.0.1:PORT",
        help="Serve streamable HTTP on this loopback address instead of stdio.",
    ),
    user: str | None = typer.Option(None, "--user", help=_USER_HELP),
    max_pending: int = typer.Option(
        DEFAULT_MAX_PENDING, "--max-pending", min=1, max=1000, help="Tasks in flight at most."
    ),
    listen_fd: int | None = typer.Option(
        None,
        "--listen-fd",
        min=3,
        hidden=True,
        help="Serve --http on this inherited listening socket (set by agentbox serve).",
    ),
) -> None:
    """Run the MCP server (stdio by default: claude mcp add agentbox -- agentbox mcp)."""
    from agentbox.mcp import parse_listen, prepare, run_http, run_stdio

    settings = load_settings()
    listen = parse_listen(http) if http else None  # refuse a bad bind before anything else
    prepared = prepare(
        settings,
        user=user or os.environ.get("AGENTBOX_MCP_USER"),
        want_token=listen is not None,
        max_pending=max_pending,
    )
    if listen is None:
        run_stdio(prepared)
    else:
        run_http(prepared, *listen, listen_fd=listen_fd)


def serve_cmd(
    http: str = typer.Option(
        "127.0.0.1:8765", "--http", metavar="127.0.0.1:PORT", help="Loopback address of the MCP."
    ),
    user: str | None = typer.Option(None, "--user", help=_USER_HELP),
    max_pending: int = typer.Option(DEFAULT_MAX_PENDING, "--max-pending", min=1, max=1000),
    metrics: str | None = typer.Option(
        None, "--metrics", metavar="127.0.0.1:PORT", help="The launcher's Prometheus metrics."
    ),
    ui: str | None = typer.Option(
        None, "--ui", metavar="127.0.0.1:PORT", help="Also serve the web view (agentbox ui)."
    ),
) -> None:
    """Run the launcher and the MCP HTTP server together; Ctrl-C stops both."""
    from agentbox.mcp import serve

    settings = load_settings()
    if metrics is not None:
        from agentbox.launcher.metrics import parse_listen

        parse_listen(metrics)  # refused here, before anything starts
    if ui is not None:
        from agentbox.core.listen import parse_loopback

        parse_loopback(ui, flag="--ui", who="the web view")
    code = serve(
        settings,
        http,
        user=user or os.environ.get("AGENTBOX_MCP_USER"),
        max_pending=max_pending,
        metrics=metrics,
        ui=ui,
    )
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add ``mcp`` and ``serve`` to the CLI."""
    app.command("mcp")(mcp)
    app.command("serve")(serve_cmd)
