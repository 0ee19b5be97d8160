"""``agentbox image build|ls|rm``: the default image, Containerfile images, and their cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentbox.config import load_settings
from agentbox.core.console import console as make_console

image_app = typer.Typer(help="Build, list and remove sandbox images.", no_args_is_help=True)

_out = make_console()
_err = make_console(stderr=True)


def _info_dict(info: Any) -> dict[str, Any]:
    return {
        "name": info.name,
        "hash": info.hash,
        "rootfs": str(info.rootfs) if info.rootfs else None,
        "podman_id": info.podman_id,
        "cached": info.cached,
    }


class _PhaseProgress:
    """Shows the current phase with a spinner and its elapsed time; logs each finished phase."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task = progress.add_task("starting", total=None)
        self._phase = ""
        self._since = time.monotonic()

    def __call__(self, message: str) -> None:
        phase, _, detail = message.partition(": ")
        now = time.monotonic()
        if phase != self._phase:
            if self._phase:
                self._progress.console.print(
                    f"[green]✓[/green] {self._phase} [dim]({now - self._since:.1f}s)[/dim]"
                )
            self._phase, self._since = phase, now
            self._progress.reset(self._task)
        self._progress.update(self._task, description=f"[bold]{phase}[/bold] {detail}"[:160])


@image_app.command("build")
def build(
    containerfile: Annotated[
        Path | None,
        typer.Option(
            "--containerfile",
            help="Build from this Containerfile (usually FROM localhost/agentbox-base) "
            "instead of the default image",
        ),
    ] = None,
    context: Annotated[
        Path | None,
        typer.Option("--context", help="The build context (default: the Containerfile's dir)"),
    ] = None,
    tag: Annotated[
        str | None, typer.Option("--tag", help="Also tag the Containerfile image with this name")
    ] = None,
    force: bool = typer.Option(False, "--force", help="Rebuild the Debian base and the image"),
    as_json: bool = typer.Option(False, "--json", help="No progress; print the result as JSON"),
) -> None:
    """Build the default image, or one from a Containerfile with agentbox's layer.

    Both are hardened and verified the same way and cached by content hash
    (seconds when nothing changed). The default build also makes
    localhost/agentbox-base, the usual FROM of a Containerfile.
    """
    from agentbox.image import build_containerfile, build_default

    settings = load_settings()
    if containerfile is None and (context is not None or tag is not None):
        raise typer.BadParameter("--context and --tag go with --containerfile")

    def run(progress: Any = None) -> Any:
        if containerfile is None:
            return build_default(settings, force=force, progress=progress)
        return build_containerfile(
            settings, containerfile, context=context, tag=tag, force=force, progress=progress
        )

    if as_json:
        print(json.dumps(_info_dict(run())))
        return
    started = time.monotonic()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=_err,
        transient=True,
    ) as progress:
        info = run(_PhaseProgress(progress))
    took = time.monotonic() - started
    state = "up to date" if info.cached else "built"
    _out.print(
        f"[green]{state}[/green] {info.name} [dim]hash {info.hash} · {took:.1f}s[/dim]",
        highlight=False,
    )
    if info.rootfs:
        _out.print(f"  root directory: {info.rootfs}", highlight=False)


@image_app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """List the images agentbox built (in podman and/or kept as a root directory).

    Images built FROM them carry the same hash label but are not listed.
    """
    from agentbox.image import list_images, manifest

    infos = list_images(load_settings())
    if as_json:
        rows = []
        for i in infos:
            m = manifest(i) or {}
            kind = m.get("kind") or ("default" if m else None)
            rows.append({**_info_dict(i), "kind": kind, "created": m.get("created")})
        print(json.dumps(rows))
        return
    table = Table("name", "hash", "podman id", "root dir", "created")
    for col in table.columns[1:]:
        col.no_wrap = True
    table.columns[0].overflow = "fold"
    for i in infos:
        m = manifest(i) or {}
        table.add_row(
            i.name,
            i.hash or "-",
            (i.podman_id or "-")[:12],
            "kept" if i.rootfs else "-",
            str(m.get("created") or "-")[:16].replace("T", " "),
        )
    _out.print(table)
    if not infos:
        _out.print("no images yet: run `agentbox image build`")


@image_app.command("rm")
def rm(
    name_or_hash: str = typer.Argument(..., help="An image name or content hash from `image ls`"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON"),
) -> None:
    """Remove one image agentbox built: its podman tags and its kept root directory.

    Refuses images agentbox did not build (images built FROM one included) and
    an image that another image is built on.
    """
    from agentbox.image import remove

    removed = remove(load_settings(), name_or_hash)
    if as_json:
        print(json.dumps({"removed": removed}))
        return
    for r in removed:
        _out.print(f"removed {r}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``agentbox image …`` to the CLI."""
    app.add_typer(image_app, name="image")
