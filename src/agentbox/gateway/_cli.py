"""The ``gateway`` command (typer), kept apart from :mod:`agentbox.cli` so that a gateway process
(``python -m agentbox.gateway``, what :func:`spawn_gateway` runs) imports only what it needs:
the full CLI pulls in every area (the MCP SDK, the launcher …) and costs ~0.5 s of CPU more
at every task's start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def gateway(
    listen: Annotated[
        str, typer.Option(help="unix:/path/sock or tcp:127.0.0.1:PORT (loopback only)")
    ],
    model: Annotated[str, typer.Option(help="Model name from the registry")],
    token: Annotated[
        str | None, typer.Option(help="The task token (visible in ps: prefer --token-file)")
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the task token (mode 0600)")
    ] = None,
    budget: Annotated[
        int, typer.Option(help="Token budget (weighted input+output+cache)")
    ] = 20_000_000,
    budget_usd: Annotated[
        float | None, typer.Option(help="Dollar budget at the model's prices (default: none)")
    ] = None,
    models_file: Annotated[Path | None, typer.Option(help="Model registry (TOML)")] = None,
    builtin_models: Annotated[
        bool,
        typer.Option(
            help="Use the built-in registry unless --models-file is given; read no settings "
            "(how the launcher starts gateways: it already resolved the models file)"
        ),
    ] = False,
    upstream: Annotated[
        str | None,
        typer.Option(help="Override the upstream: http(s)://URL, unix:/path or replay:SCRIPT"),
    ] = None,
    upstream_key_env: Annotated[
        str | None, typer.Option(help="Env var holding the upstream key")
    ] = None,
    usage_file: Annotated[
        Path | None, typer.Option(help="Running totals, JSON, replaced atomically")
    ] = None,
    max_body: Annotated[int, typer.Option(help="Request body cap in bytes")] = 32 << 20,
    max_held: Annotated[
        int, typer.Option(help="Request bytes in flight at once across requests (more: 429)")
    ] = 64 << 20,
    max_memory: Annotated[
        int, typer.Option(help="Address space limit (RLIMIT_AS) in bytes; 0: none")
    ] = 1 << 30,
    max_concurrency: Annotated[int, typer.Option(help="Concurrent requests allowed")] = 16,
    max_connections: Annotated[
        int, typer.Option(help="Open connections allowed; more are closed on accept")
    ] = 128,
    header_timeout: Annotated[
        float, typer.Option(help="Seconds to receive a request's headers")
    ] = 10.0,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds to receive a request's body after its headers")
    ] = 120.0,
    user: Annotated[
        str | None, typer.Option(help="Drop to this UID[:GID] once listening (start as root)")
    ] = None,
    ready_fd: Annotated[
        int | None, typer.Option(help="Write 'ready' to this inherited fd once serving")
    ] = None,
    exit_at: Annotated[
        float | None,
        typer.Option(help="Stop by itself at this unix time (a task's deadline plus a grace)"),
    ] = None,
) -> None:
    """Run one task's model gateway until SIGTERM.

    Started by a person (no --ready-fd), it says on stderr where it listens once it
    serves, as ``agentbox model serve`` does, so ``agentbox gateway … &`` can be waited for.
    """
    from agentbox.gateway._command import run

    if ready_fd is None:
        ready_fd = _say_when_listening(f"gateway listening on {listen} (model {model})")
    run(
        listen=listen,
        model=model,
        token=token,
        token_file=token_file,
        budget=budget,
        budget_usd=budget_usd,
        models_file=models_file,
        builtin_models=builtin_models,
        upstream=upstream,
        upstream_key_env=upstream_key_env,
        usage_file=usage_file,
        max_body=max_body,
        max_held=max_held,
        max_memory=max_memory,
        max_concurrency=max_concurrency,
        max_connections=max_connections,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        user=user,
        ready_fd=ready_fd,
        exit_at=exit_at,
    )


def _say_when_listening(line: str) -> int:
    """A descriptor for ``--ready-fd``: once the gateway writes ``ready`` to it, ``line``
    goes to stderr (from a thread, so the gateway's own start is not delayed)."""
    import os
    import sys
    import threading

    read_end, write_end = os.pipe()

    def wait() -> None:
        with os.fdopen(read_end, "rb") as fh:
            if fh.read(5) == b"ready":  # nothing: the gateway ended before it served
                sys.stderr.write(f"{line}; Ctrl-C stops it\n")
                sys.stderr.flush()

    threading.Thread(target=wait, name="agentbox-gateway-ready", daemon=True).start()
    return write_end
