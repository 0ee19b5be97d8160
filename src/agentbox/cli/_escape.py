"""``agentbox escape-test``: prove this host's confinement with the escape suite.

Starts real sandboxes, runs the probes inside them and the posture checks on
the host, and prints one table (or JSON with ``--json``). ``--controls`` also
runs the positive controls: deliberately weakened sandboxes on which every
probe must fire. Exits 1 when any probe failed or any control stayed quiet.
"""

from __future__ import annotations

import sys

import typer

__all__ = ["register"]

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
    from agentbox import _host

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
        console = Console(width=max(Console().width, 160))
        for r in reports:
            print_report(r, console)
    if not all(r.ok for r in reports):
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    """Add ``escape-test`` to the ``agentbox`` app."""
    app.command("escape-test")(escape_test)
