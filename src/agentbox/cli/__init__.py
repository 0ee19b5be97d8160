"""The ``agentbox`` command line (typer + rich).

Each area registers its commands from its own module (``_image.py``,
``_sandbox.py``, ``_gateway.py``, ``_tasks.py``, ``_mcp.py``, ``_escape.py``);
this module only assembles them and maps errors to exit codes. A command's module is
imported only when that command runs (:mod:`agentbox.cli._lazy`), so ``agentbox
--help`` or ``agentbox launcher serve`` does not pay for the MCP SDK, the model
registry or rich tables.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
import typer.core

from agentbox.cli._lazy import LazyGroup, app_options
from agentbox.core.text import visible
from agentbox.errors import AgentboxError, RefusedError, UncommittedChanges, UnsupportedError

__all__ = ["app", "entry", "error_message", "main"]

app = typer.Typer(cls=LazyGroup, **app_options())

#: Modules under agentbox.cli that each define ``register(app)``, in the order their
#: commands are listed (each imported when one of its commands runs: see _lazy.COMMANDS).
COMMAND_MODULES: tuple[str, ...] = (
    "_mcp",
    "_ui",
    "_tasks",
    "_launcher",
    "_run",
    "_wait",
    "_diff",
    "_publish",
    "_gateway",
    "_image",
    "_doctor",
    "_sandbox",
    "_escape",
    "_retention",
    "_env",
    "_secret",
    "_batch",
)

_display_type_rich = typer.core.TyperOption.display_type_rich


def _flag_type(self: typer.core.TyperOption, ctx: Any) -> str | None:
    # typer's rich help shows every option's type, flags too (``--json <bool>``), which
    # reads as an option taking a value: a flag shows none, as in click's own help.
    if self.is_flag and not self.count:
        return None
    return _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]


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
    from agentbox.core.log import configure

    configure(log_level, json=log_json)


#: The root click command built ahead (:func:`prebuild`, by the front end's server before
#: it forks commands), else None: each command builds its own from ``app``.
_prebuilt: Any = None


def prebuild(names: tuple[str, ...]) -> None:
    """Build the root click command, its commands ``names`` (their modules imported) and
    every one of their parameters' type conversions, and keep it for :func:`main`: a
    process forked from this one (:mod:`agentbox.front.server`) then parses its argv
    without building them again (~10 ms of ``agentbox run``'s start). Nothing in it
    depends on the environment or argv: they are read when a command parses them."""
    global _prebuilt
    import typer.main
    from typer import _click

    group = typer.main.get_command(app)
    ctx = _click.Context(group)
    todo: list[Any] = [group]
    for name in names:
        if (cmd := group.get_command(ctx, name)) is not None:  # type: ignore[attr-defined]
            todo.append(cmd)
    while todo:
        cmd = todo.pop()
        # Its --help option too (made, and kept, at its first parse; named as its context,
        # made with its settings, names it).
        ctx = _click.Context(cmd, **cmd.context_settings)
        for param in [*cmd.params, cmd.get_help_option(ctx)]:
            if hasattr(param, "get_runtime_param"):
                param.get_runtime_param()
        todo.extend(getattr(cmd, "commands", {}).values())
    _prebuilt = group


def _app(**kwargs: Any) -> Any:
    """``app(**kwargs)``, on the command :func:`prebuild` built if it did (as typer runs
    it: its exception hook set)."""
    if _prebuilt is None:
        return app(**kwargs)
    import typer.main

    if sys.excepthook != typer.main.except_hook:
        sys.excepthook = typer.main.except_hook
    return _prebuilt(**kwargs)


def entry() -> NoReturn:
    """The ``agentbox`` command (console script, ``python -m agentbox``): :func:`main`,
    then the process ends without the interpreter's teardown (0.3-0.4 s of CPU after
    ``agentbox run`` printed its result; :func:`agentbox.core.exit.end_process`)."""
    from agentbox.core.exit import end_process, exit_code

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    end_process(code)


def main() -> None:
    """Run the app; agentbox errors become one red line and an exit code.

    Usage errors are click's (exit 2); refusals exit 3, missing host facilities 4,
    other agentbox errors 1.
    """
    as_json = "--json" in sys.argv[1:]
    try:
        if not as_json:
            _app()
            return
        # --json: usage errors too come out as JSON, so run click non-standalone.
        rv: Any = _app(standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except AgentboxError as exc:
        code = 3 if isinstance(exc, RefusedError) else 4 if isinstance(exc, UnsupportedError) else 1
        message = error_message(exc)
        if as_json:
            _json_error(error_kind(exc), message)
        else:
            from rich.console import Console
            from rich.text import Text

            # The message may hold untrusted text (paths, agent output): never markup.
            Console(stderr=True).print(
                Text.assemble(("error: ", "red"), visible(message)),
                highlight=False,
                soft_wrap=True,  # one line per error: no breaks (and padding) at 80 columns
            )
        sys.exit(code)
    except typer.TyperException as exc:  # usage errors (only raised here under --json)
        _json_error(error_kind(exc), exc.format_message())
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        _json_error("interrupted", "interrupted")
        sys.exit(130)


def error_message(exc: AgentboxError) -> str:
    """What the command line says of ``exc``: an option is named as this CLI spells it."""
    if isinstance(exc, UncommittedChanges):
        return exc.with_option("--include-uncommitted")
    return str(exc)


def error_kind(exc: BaseException) -> str:
    """A stable snake_case key for an error class (``PolicyRefused`` -> ``policy_refused``)."""
    name = type(exc).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _json_error(kind: str, message: str) -> None:
    """An error as one JSON object on stdout, where ``--json`` output goes."""
    doc = {"error": kind, "message": visible(message)}
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
