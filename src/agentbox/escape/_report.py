"""Printing a report: one rich table (probe, tried, expected, seen, verdict), or JSON."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from agentbox.escape._model import Outcome, Report

_STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "n/a": "yellow"}


def _table(title: str, rows: list[Outcome], *, control: bool = False) -> Table:
    t = Table(title=title, show_lines=False, expand=True)
    t.add_column("probe", no_wrap=True)
    t.add_column("where", no_wrap=True)
    t.add_column("tried", ratio=2)
    t.add_column("expected", ratio=1)
    t.add_column("seen", ratio=3)
    t.add_column("control" if control else "result", no_wrap=True)
    for o in rows:
        verdict = (
            {"pass": "fired", "fail": "QUIET"}.get(o.status, o.status) if control else o.status
        )
        t.add_row(
            o.id, o.where, o.tried, o.expected, o.seen,
            f"[{_STYLE[o.status]}]{verdict}[/]",
        )  # fmt: skip
    return t


def print_report(report: Report, console: Console | None = None) -> None:
    """The human table; a summary line says what failed."""
    console = console or Console()
    title = f"escape suite: {report.backend}/{report.runtime} ({report.isolation})"
    console.print(_table(title, report.outcomes))
    if report.controls:
        console.print(
            _table("positive controls (each probe must fire)", report.controls, control=True)
        )
    counts: dict[str, int] = {}
    for o in report.outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    if report.controls:
        fired = sum(1 for c in report.controls if c.status == "pass")
        summary += f"; controls: {fired}/{len(report.controls)} fired"
    verdict = "[green]OK[/]" if report.ok else f"[bold red]{len(report.failures)} FAILED[/]"
    console.print(f"{len(report.outcomes)} probes: {summary} in {report.seconds:.1f}s: {verdict}")
    for f in report.failures:
        console.print(f"  [red]✗[/] {f.id}: {f.seen}", highlight=False)


def report_json(reports: list[Report]) -> str:
    """The JSON printed by ``--json``: one object per backend/runtime run."""
    return json.dumps(
        {"ok": all(r.ok for r in reports), "runs": [r.to_dict() for r in reports]}, indent=2
    )
