"""The ``gateway`` command, kept apart from :mod:`agentbox.cli` so that a gateway process
(``python -m agentbox.gateway``, what :func:`spawn_gateway` runs) imports only what it needs:
the full CLI pulls in every area (the MCP SDK, the launcher …) and costs ~0.5 s of CPU more
at every task's start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentbox.config import load_settings

__all__ = ["gateway"]


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
    models_file: Annotated[Path | None, typer.Option(help="Model registry (TOML)")] = None,
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
    """Run one task's model gateway until SIGTERM."""
    from agentbox.gateway._logcap import log_file_limit
    from agentbox.gateway._run import parse_user, read_token, run_gateway
    from agentbox.gateway.registry import load_registry

    settings = load_settings()
    entry = load_registry(settings, models_file).get(model)
    run_gateway(
        listen=listen,
        token=read_token(token=token, token_file=token_file),
        entry=entry,
        budget=budget,
        upstream=upstream,
        key_env=upstream_key_env,
        usage_file=usage_file,
        max_body=max_body,
        max_held=max_held,
        max_memory=max_memory or None,
        max_file=log_file_limit(),
        max_concurrency=max_concurrency,
        max_connections=max_connections,
        header_timeout=header_timeout,
        exit_at=exit_at,
        body_timeout=body_timeout,
        run_as=parse_user(user) if user is not None else None,
        ready_fd=ready_fd,
    )
