"""``agentbox escape-test``: prove this host's confinement with the escape suite.

Starts real sandboxes, runs the probes inside them and the posture checks on
the host, and prints one table (or JSON with ``--json``). ``--controls`` also
runs the positive controls: deliberately weakened sandboxes on which every
probe must fire. Exits 1 when any probe failed or any control stayed quiet.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

BackendOpt = typer.Option("podman", "--backend", "-b", help="podman, qemu, …")
RuntimeOpt = typer.Option(
    None,
    "--runtime",
    "-r",
    help="OCI runtime (podman): runc, crun, runsc; repeat it, or 'all' for every usable one",
)
IsolationOpt = typer.Option("standard", "--isolation", help="standard or strict")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of the table")
ControlsOpt = typer.Option(False, "--controls", help="Also run the positive controls")
ImageOpt = typer.Option(None, "--image", help="Image to test (default: the configured one)")


def _runtimes(runtimes: tuple[str, ...], asked: list[str] | None, default: str) -> list[str]:
    """The runtimes to test: ``runtimes`` is what the backend offers (empty: it has none)."""
    from agentbox.core import host as _host

    if not asked:
        return [default]
    if asked == ["all"]:
        if not runtimes:
            return [default]
        return [r for r in runtimes if _host.podman_runtime(r).ok]
    return asked


def escape_test(
    backend: str = BackendOpt,
    runtime: list[str] | None = RuntimeOpt,
    isolation: str = IsolationOpt,
    as_json: bool = JsonOpt,
    controls: bool = ControlsOpt,
    image: str | None = ImageOpt,
) -> None:
    """Run the escape suite: probes inside real sandboxes, checks from the host, controls."""
    from rich.console import Console

    from agentbox.backends import get_backend
    from agentbox.config import load_settings
    from agentbox.errors import ConfigError
    from agentbox.escape import print_report, report_json, run_suite

    if isolation not in ("standard", "strict"):
        raise ConfigError(f"--isolation must be standard or strict, not {isolation!r:.40}")
    settings = load_settings()
    be = get_backend(backend, settings)
    reports = []
    for i, rt in enumerate(_runtimes(be.runtimes, runtime, settings.runtime)):
        # The controls prove the probes, not the runtime: once per invocation is enough.
        reports.append(
            run_suite(
                be, settings, runtime=rt, isolation=isolation, image=image,
                controls=controls and i == 0,
            )
        )  # fmt: skip
    if as_json:
        sys.stdout.write(report_json(reports) + "\n")
    else:
        # The terminal's width (80 when piped), never wider; piped, no trailing padding.
        console = Console()
        with console.capture() as cap:
            for r in reports:
                if console.width >= WIDE:
                    print_report(r, console)
                else:
                    _print_narrow(r, console)
        text = cap.get()
        if not console.is_terminal:
            text = "".join(ln.rstrip() + "\n" for ln in text.splitlines())
        sys.stdout.write(text)
    if not all(r.ok for r in reports):
        raise SystemExit(1)


#: Below this many columns the six-column table would cut every cell: a narrower one
#: (probe, result, where, what was seen) is printed; --json has everything.
WIDE = 120


def _print_narrow(report: Any, console: Any) -> None:
    from rich.text import Text

    from agentbox.cli._table import Col, fit_table
    from agentbox.core.text import visible

    styles = {"pass": "green", "fail": "bold red", "error": "bold red", "n/a": "yellow"}
    cols = [Col("probe", keep=True), Col("result", keep=True), Col("where"),
            Col("seen", ratio=2), Col("expected", ratio=1)]  # fmt: skip
    for title, rows, control in (
        (f"escape suite: {report.backend}/{report.runtime} ({report.isolation})",
         report.outcomes, False),
        ("positive controls (each probe must fire)", report.controls, True),
    ):  # fmt: skip
        if not rows:
            continue
        cells = []
        for o in rows:
            verdict = (
                {"pass": "fired", "fail": "QUIET"}.get(o.status, o.status) if control else o.status
            )
            # What a probe saw came from inside the sandbox: printed as visible text.
            seen, expected = Text(visible(o.seen)), Text(visible(o.expected))
            cells.append([Text(o.id), Text(verdict, style=styles.get(o.status, "")),
                          Text(o.where), seen, expected])  # fmt: skip
        console.print(fit_table(console, cols, cells, title=title))
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
        console.print(Text.assemble(("  ✗ ", "red"), visible(f"{f.id}: {f.seen}")))


def register(app: typer.Typer) -> None:
    """Add ``escape-test`` to the ``agentbox`` app."""
    app.command("escape-test")(escape_test)
