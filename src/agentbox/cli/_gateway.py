"""``agentbox gateway``, ``agentbox model serve`` and ``agentbox models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from agentbox.config import load_settings
from agentbox.gateway import gateway_command as gateway

model_app = typer.Typer(help="The replay model and other model tools.", no_args_is_help=True)


@model_app.command("serve")
def model_serve(
    script: Annotated[Path, typer.Option(help="Replay script (YAML or JSON)")],
    listen: Annotated[str, typer.Option(help="unix:/path/sock or tcp:127.0.0.1:PORT")],
    log_requests: Annotated[
        Path | None, typer.Option(help="Append every request to this JSONL file")
    ] = None,
) -> None:
    """Serve the replay model alone (a scripted Messages API server).

    Says on stderr where it listens once the socket accepts connections (the real
    port for ``tcp:127.0.0.1:0``), so a script started in the background can wait for it.
    """
    from agentbox.gateway import run_replay

    def _ready(addr: str) -> None:
        typer.echo(f"replay model listening on {addr} (script {script}); Ctrl-C stops it", err=True)

    run_replay(script=script, listen=listen, log_path=log_requests, on_listening=_ready)


def models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
    models_file: Annotated[Path | None, typer.Option(help="Model registry (TOML)")] = None,
) -> None:
    """List the models clients may choose: which is the default, which need a key not set."""
    from agentbox.cli._table import Col, fit_table, print_table
    from agentbox.gateway.registry import load_registry

    reg = load_registry(load_settings(), models_file)
    default, default_reason = reg.default_for()
    if as_json:
        rows = [
            {
                "name": e.name,
                "kind": e.kind,
                "upstream_model": e.target_model,
                "key_env": e.key_env,
                "description": e.description,
                "default": e.name == default,
                "default_reason": default_reason if e.name == default else "",
                "available": e.unavailable() is None,
                "unavailable_reason": e.unavailable() or "",
                "scripted": e.scripted,
                # USD per million tokens; null: the price is unknown (never $0).
                "price": e.price.to_json() if e.price is not None else None,
                "retired": e.retired,
            }
            for e in reg
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    console = Console()
    cols = [
        Col("name", keep=True), Col("available"), Col("kind"), Col("upstream model"),
        Col("$/MTok in/out"), Col("description", ratio=1),
    ]  # fmt: skip
    table_rows = []
    for e in reg:
        why = e.unavailable()
        name = f"{e.name} (default)" if e.name == default else e.name
        price = f"{e.price.input:g} / {e.price.output:g}" if e.price else "unknown"
        if e.scripted:
            price = "scripted"
        table_rows.append([name, "yes" if why is None else f"no: {why}", e.kind, e.target_model,
                           price, e.description])  # fmt: skip
    print_table(console, fit_table(console, cols, table_rows, title=f"models ({reg.source})"))
    console.print(f"default: {default} ({default_reason})", soft_wrap=True)
    for e in reg:
        if e.retired:
            console.print(
                f"warning: [models.{e.name}] names {e.target_model}, retired by its provider "
                f"on {e.retired}: update the registry",
                soft_wrap=True,
                markup=False,
            )


def register(app: typer.Typer) -> None:
    """Add the gateway commands to the ``agentbox`` app."""
    app.command("gateway")(gateway)
    app.command("models")(models)
    app.add_typer(model_app, name="model")
