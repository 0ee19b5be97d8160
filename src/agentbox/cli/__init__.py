"""The ``agentbox`` command line (typer + rich).

Each area registers its commands from its own module (``_image.py``,
``_sandbox.py``, ``_gateway.py``, ``_tasks.py``, ``_mcp.py``, ``_escape.py``);
this module only assembles them and maps errors to exit codes.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console
from rich.text import Text

from agentbox._log import configure
from agentbox._text import visible
from agentbox.errors import AgentboxError, RefusedError, UnsupportedError

__all__ = ["app", "main"]

app = typer.Typer(
    name="agentbox",
    help="Run coding agents in sandboxes that assume the worst.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

#: Modules under agentbox.cli that each define ``register(app)``.
COMMAND_MODULES: tuple[str, ...] = (
    "_mcp",
    "_tasks",
    "_publish",
    "_gateway",
    "_image",
    "_doctor",
    "_sandbox",
    "_escape",
    "_retention",
    "_env",
)

err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from agentbox import __version__

        print(f"agentbox {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
    log_level: str = typer.Option("WARNING", "--log-level", envvar="AGENTBOX_LOG_LEVEL"),
    log_json: bool = typer.Option(False, "--log-json", envvar="AGENTBOX_LOG_JSON"),
) -> None:
    """agentbox: hardened sandboxes for AI coding agents."""
    configure(log_level, json=log_json)


for _mod in COMMAND_MODULES:
    importlib.import_module(f"agentbox.cli.{_mod}").register(app)


def main() -> None:
    """Entry point: run the app; agentbox errors become one red line and an exit code.

    Usage errors are click's (exit 2); refusals exit 3, missing host facilities 4,
    other agentbox errors 1.
    """
    try:
        app()
    except AgentboxError as exc:
        # The message may hold untrusted text (paths, agent output): never parse it as markup.
        err_console.print(Text.assemble(("error: ", "red"), visible(str(exc))), highlight=False)
        code = 3 if isinstance(exc, RefusedError) else 4 if isinstance(exc, UnsupportedError) else 1
        sys.exit(code)
