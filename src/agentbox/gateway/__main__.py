"""``python -m agentbox.gateway …``: the ``agentbox gateway`` command alone, lean.

One of these runs per task for the task's whole life, so what it imports is paid
once per task in memory. It imports no part of agentbox it does not
serve with (the Boxfile model, the settings loader, the CLI), parses its
arguments with :mod:`argparse` instead of typer (click and typer are ~6 MiB of
private memory per process), and keeps ``rich`` out: a gateway renders nothing
in colour (rich alone is ~5 MiB). The import is blocked the documented way
(``sys.modules[name] = None``).

The options are those of ``agentbox gateway`` (:func:`agentbox.gateway._cli.gateway`,
the typer command), same names, types and defaults: ``tests/unit/test_gateway_lean.py``
compares the two, and checks what a gateway process may not import.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

#: Modules a gateway process never imports.
BLOCKED = ("rich",)

#: ``(option, type, default, help)``; a default of ``...`` means required.
OPTIONS: tuple[tuple[str, Any, Any, str], ...] = (
    ("listen", str, ..., "unix:/path/sock or tcp:127.0.0.1:PORT (loopback only)"),
    ("model", str, ..., "Model name from the registry"),
    ("token", str, None, "The task token (visible in ps: prefer --token-file)"),
    ("token-file", Path, None, "File holding the task token (mode 0600)"),
    ("budget", int, 20_000_000, "Token budget (weighted input+output+cache)"),
    ("budget-usd", float, None, "Dollar budget at the model's prices (default: none)"),
    ("models-file", Path, None, "Model registry (TOML)"),
    ("builtin-models", bool, False, "Use the built-in registry unless --models-file is given"),
    ("upstream", str, None, "Override the upstream: http(s)://URL, unix:/path or replay:SCRIPT"),
    ("upstream-key-env", str, None, "Env var holding the upstream key"),
    ("usage-file", Path, None, "Running totals, JSON, replaced atomically"),
    ("max-body", int, 32 << 20, "Request body cap in bytes"),
    ("max-held", int, 64 << 20, "Request bytes in flight at once across requests"),
    ("max-memory", int, 1 << 30, "Address space limit (RLIMIT_AS) in bytes; 0: none"),
    ("max-concurrency", int, 16, "Concurrent requests allowed"),
    ("max-connections", int, 128, "Open connections allowed; more are closed on accept"),
    ("header-timeout", float, 10.0, "Seconds to receive a request's headers"),
    ("body-timeout", float, 120.0, "Seconds to receive a request's body after its headers"),
    ("user", str, None, "Drop to this UID[:GID] once listening (start as root)"),
    ("ready-fd", int, None, "Write 'ready' to this inherited fd once serving"),
    ("exit-at", float, None, "Stop by itself at this unix time (a task's deadline plus a grace)"),
)


@functools.cache
def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m agentbox.gateway`` (built once: a gateway forked
    from the template parses with the one it built, without argparse's 10 ms of set-up)."""
    ap = argparse.ArgumentParser(
        prog="python -m agentbox.gateway", description="Run one task's model gateway until SIGTERM."
    )
    for name, kind, default, text in OPTIONS:
        if kind is bool:
            ap.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default,
                            help=text)  # fmt: skip
        else:
            ap.add_argument(f"--{name}", type=kind, default=None if default is ... else default,
                            required=default is ..., help=text)  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    """Run the gateway command; agentbox errors become one line on stderr and an exit code."""
    for name in BLOCKED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    args = parser().parse_args(argv)

    from agentbox.core.log import configure
    from agentbox.errors import AgentboxError, RefusedError
    from agentbox.gateway._command import run
    from agentbox.gateway._logcap import cap_log

    cap_log()  # before anything holds sys.stderr (uvicorn's handlers)
    configure()
    try:
        run(**vars(args))
    except AgentboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3 if isinstance(exc, RefusedError) else 1)


if __name__ == "__main__":
    main()
