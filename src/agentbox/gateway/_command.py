"""What the ``gateway`` command does, without typer: shared by ``agentbox gateway``
(:mod:`._cli`) and ``python -m agentbox.gateway`` (:mod:`.__main__`, argparse)."""

from __future__ import annotations

from pathlib import Path


def run(
    *,
    listen: str,
    model: str,
    token: str | None,
    token_file: Path | None,
    budget: int,
    models_file: Path | None,
    builtin_models: bool,
    upstream: str | None,
    upstream_key_env: str | None,
    usage_file: Path | None,
    max_body: int,
    max_held: int,
    max_memory: int,
    max_concurrency: int,
    max_connections: int,
    header_timeout: float,
    body_timeout: float,
    user: str | None,
    ready_fd: int | None,
    exit_at: float | None,
    budget_usd: float | None = None,
) -> None:
    """Run one task's model gateway until SIGTERM (options as ``agentbox gateway --help``)."""
    from agentbox.gateway._logcap import log_file_limit
    from agentbox.gateway._run import parse_user, read_token, run_gateway
    from agentbox.gateway.registry import load_registry

    settings = None
    if models_file is None and not builtin_models:
        # Only to find a models file: the settings loader (pydantic-settings) is ~5 MiB
        # of memory a per-task gateway would hold for nothing.
        from agentbox.config import load_settings

        settings = load_settings()
    entry = load_registry(settings, models_file).get(model)
    run_gateway(
        listen=listen,
        token=read_token(token=token, token_file=token_file),
        entry=entry,
        budget=budget,
        budget_usd=budget_usd,
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
