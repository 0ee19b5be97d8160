"""``agentbox doctor``: what this host supports, and how to fix each missing piece.

Every row is a :class:`~agentbox.core.host.Facility` probe. The command exits 0 when
the essentials are there (podman, runc, and what ``agentbox image build``
needs); optional pieces (crun, gVisor, KVM, QEMU, bubblewrap) only widen the
choice of backends and runtimes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console, RenderableType
from rich.text import Text

from agentbox.cli._table import Col, fit_table, print_table
from agentbox.config import Settings, load_settings
from agentbox.core import host as _host
from agentbox.errors import AgentboxError


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table."""

    facility: _host.Facility
    essential: bool
    status: str
    """``ok``, ``missing``, ``refused`` (present but unusable here) or ``partial``."""

    def as_dict(self) -> dict[str, Any]:
        f = self.facility
        return {
            "name": f.name,
            "ok": f.ok,
            "status": self.status,
            "essential": self.essential,
            "detail": f.detail,
            "fix": f.fix,
        }


def _row(fac: _host.Facility, *, essential: bool = False, present: bool | None = None) -> Check:
    if fac.ok:
        return Check(fac, essential, "ok")
    return Check(fac, essential, "refused" if present else "missing")


def _binary(name: str, binary: str, package: str, *, what: str = "") -> _host.Facility:
    path = shutil.which(binary)
    if path is None:
        return _host.Facility(name, False, f"{binary} not installed", f"apt-get install {package}")
    return _host.Facility(name, True, f"{path}{what}")


def _apt_sources() -> _host.Facility:
    from agentbox.image import SUITE, host_apt_sources

    try:
        src = host_apt_sources()
    except AgentboxError as exc:
        return _host.Facility("apt sources", False, str(exc), f"add a Debian {SUITE} apt source")
    return _host.Facility(
        "apt sources", True, f"{SUITE} from " + ", ".join(str(p) for p in src.origin)
    )


def _image(settings: Settings) -> _host.Facility:
    from agentbox.image import resolve

    try:
        info = resolve(settings)
    except AgentboxError as exc:
        return _host.Facility("image", False, str(exc), "agentbox image build")
    extra = f", hash {info.hash}" if info.hash else ""
    root = f", root dir {info.rootfs}" if info.rootfs else ""
    return _host.Facility("image", True, f"{info.name}{extra}{root}")


def _models(settings: Settings) -> Check:
    """The model registry loads, and names no model id its provider retired (a warning:
    every task of such an entry would fail at its first request)."""
    from agentbox.gateway.registry import load_registry

    try:
        reg = load_registry(settings)
    except AgentboxError as exc:
        fac = _host.Facility("models", False, str(exc), "fix the models file")
        return Check(fac, False, "refused")
    retired = [e for e in reg if e.retired]
    if not retired:
        return _row(_host.Facility("models", True, f"{len(reg)} entries ({reg.source})"))
    said = "; ".join(
        f"[models.{e.name}] names {e.target_model}, retired by its provider on {e.retired}"
        for e in retired
    )
    fix = f"update the registry ({reg.source}): a current upstream_model (agentbox models)"
    return Check(_host.Facility("models", False, said, fix), False, "partial")


def checks(settings: Settings) -> list[Check]:
    """Probe everything the doctor reports, in display order."""
    from agentbox.backends.registry import doctor_rows

    out = [
        Check(r.facility, r.essential, "partial") if r.partial and not r.facility.ok
        else _row(r.facility, essential=r.essential, present=r.present)
        for r in doctor_rows(settings)
    ]  # fmt: skip
    out.append(_row(_binary("bubblewrap", "bwrap", "bubblewrap")))
    out.append(_row(_binary("mmdebstrap", "mmdebstrap", "mmdebstrap"), essential=True))
    out.append(_row(_apt_sources(), essential=True))
    out.append(_row(_host.claude_code(settings.claude_binary)))
    out.append(_row(_image(settings)))
    out.append(_models(settings))
    return out


_STYLE = {"ok": "green", "partial": "yellow", "missing": "red", "refused": "red"}


def doctor(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Report what this host supports, with a fix for each missing piece."""
    rows = checks(load_settings())
    ok = all(r.facility.ok for r in rows if r.essential)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [r.as_dict() for r in rows]}))
    else:
        console = Console()
        # Never cut: facility and status stay whole, detail and fix fold onto more lines
        # (an ellipsis would hide the one thing the user must type).
        cols = [Col("facility", keep=True), Col("status", keep=True),
                Col("detail", ratio=1), Col("fix", ratio=1)]  # fmt: skip
        cells: list[list[RenderableType]] = []
        for r in rows:
            f = r.facility
            status = f"[{_STYLE[r.status]}]{r.status}[/]" + ("" if not r.essential else " *")
            if r.essential and not f.ok:
                status = f"[bold red]{r.status} *[/]"
            fix = f.fix if not f.ok or f.fix else ""
            cells.append([Text(f.name), Text.from_markup(status), Text(f.detail), Text(fix)])
        print_table(console, fit_table(console, cols, cells))
        console.print(
            "[green]essentials present[/green] (* = essential: podman, runc, image tooling)"
            if ok
            else "[red]an essential piece is missing[/red] (* = essential)"
        )
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``agentbox doctor`` to the CLI."""
    app.command("doctor")(doctor)
