"""``agentbox env ls|rm|prune``: the frozen environments, and their lines in ``agentbox show``.

Frozen environments live in the cache dir (``envs/``, root's); these commands
read and remove them there, as root, like the launcher. ``rm`` refuses one a
running task has mounted.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from agentbox.config import load_settings
from agentbox.core.console import console as make_console
from agentbox.core.text import visible
from agentbox.env import EnvStore

console = make_console(highlight=False)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def env_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, text)`` rows for ``agentbox show``: the setup phase and the agent's egress.

    Every value may come from the sandbox (paths, host names): the caller prints it
    through the sanitizer.
    """
    rows: list[tuple[str, str]] = []
    setup = report.get("setup")
    if isinstance(setup, dict):
        cache = str(setup.get("cache", "?"))
        roots = setup.get("roots")
        what = ", ".join(str(r) for r in roots[:8]) if isinstance(roots, list) else ""
        what = what or "nothing"
        text = {
            "hit": f"cache hit (setup skipped): {what}",
            "miss": f"ran and frozen (cache miss) in {setup.get('duration_s', 0)}s: {what}",
            "failed": f"FAILED (exit {setup.get('exit_code')}"
            + (", deadline" if setup.get("timed_out") else "")
            + ")",
        }.get(cache, cache)
        if cache != "failed":
            text += f" · {_int(setup.get('files')):,} files, {_human(_int(setup.get('size')))}"
        rows.append(("setup", text))
        if isinstance(setup.get("egress"), dict):
            rows.append(("setup egress", _egress_text(setup["egress"])))
            rows += _refused_rows(setup["egress"])
    egress = report.get("egress")
    if isinstance(egress, dict):
        rows.append(("egress", _egress_text(egress)))
        rows += _refused_rows(egress)
    return rows


def _refused_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """A row per request a rule refused, with the ``[[network.rule]]`` that would allow it."""
    rows = []
    refused = summary.get("refused")
    for r in refused[:10] if isinstance(refused, list) else []:
        if not isinstance(r, dict):
            continue
        text = f"{r.get('method', '?')} {r.get('host', '?')}{r.get('path', '')}: "
        text += str(r.get("reason") or r.get("rule") or "refused")
        if isinstance(r.get("suggest"), str):
            text += "\nto allow it, add to the Boxfile:\n" + str(r["suggest"])
        rows.append(("refused", text))
    return rows


def _egress_text(summary: dict[str, Any]) -> str:
    hosts = summary.get("hosts")
    parts = []
    for h in hosts[:10] if isinstance(hosts, list) else []:
        if isinstance(h, dict):
            parts.append(
                f"{h.get('host', '?')} ({_int(h.get('allowed'))} allowed, "
                f"{_int(h.get('denied'))} denied, {_human(_int(h.get('bytes_down')))} in)"
            )
    head = f"{_int(summary.get('allowed'))} allowed, {_int(summary.get('denied'))} denied"
    if _int(summary.get("injected")):
        head += f", {_int(summary.get('injected'))} with an injected header"
    return head + (": " + "; ".join(parts) if parts else "")


def setup_tail(report: dict[str, Any]) -> str | None:
    """The failed setup's output tail (text from the sandbox: sanitize before printing)."""
    setup = report.get("setup")
    if isinstance(setup, dict) and setup.get("cache") == "failed":
        tail = setup.get("output_tail")
        return tail if isinstance(tail, str) else ""
    return None


def register(app: typer.Typer) -> None:
    """Add ``agentbox env`` to ``app``."""
    env_app = typer.Typer(help="Frozen environments made by the setup phase (ls, rm, prune).")
    app.add_typer(env_app, name="env")

    @env_app.command("ls")
    def ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """List frozen environments with their size and last use."""
        store = EnvStore(load_settings())
        envs = store.list()
        if as_json:
            print(json.dumps([e.model_dump(mode="json") for e in envs], indent=2))
            return
        table = Table(box=None)
        for col in ("key", "user", "image", "dirs", "files", "size", "last used", "uses"):
            table.add_column(col)
        for e in envs:
            table.add_row(
                e.key[:12],
                "any" if e.user is None else str(e.user),  # None: shared (or made before 33)
                Text(visible(e.image)),
                Text(visible(", ".join(e.roots))),
                f"{e.files:,}",
                _human(e.size),
                _ago(e.last_used),
                str(e.uses),
            )
        console.print(table)
        total = sum(e.size for e in envs)
        console.print(f"{len(envs)} environment(s), {_human(total)}")

    @env_app.command("rm")
    def rm(keys: Annotated[list[str], typer.Argument(help="Keys (or unique prefixes).")]) -> None:
        """Remove frozen environments (not one a running task uses)."""
        store = EnvStore(load_settings())
        known = [e.key for e in store.list()]
        for k in keys:
            match = [key for key in known if key.startswith(k)] if len(k) >= 4 else []
            if len(match) != 1:
                console.print(Text(visible(f"{k}: no single environment by that key"), "red"))
                raise typer.Exit(1)
            store.remove(match[0])
            console.print(f"removed {match[0][:12]}")

    @env_app.command("prune")
    def prune(
        older_than: Annotated[
            str,
            typer.Option(
                "--older-than",
                help="Unused for longer than this (e.g. 14d, 12h, 30m, 2w; a bare number: days).",
            ),
        ] = "14d",
        dry_run: Annotated[
            bool, typer.Option("--dry-run", "-n", help="Say what would go; remove nothing.")
        ] = False,
    ) -> None:
        """Remove environments unused for --older-than (default 14 days); not one in use."""
        from agentbox.launcher import parse_age  # `agentbox prune`'s syntax

        try:
            age = parse_age(older_than)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--older-than") from exc
        store = EnvStore(load_settings())
        gone = store.prune(age, dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        for e in gone:
            console.print(f"{verb} {e.key[:12]} ({_human(e.size)}, last used {_ago(e.last_used)})")
        freed = "would free" if dry_run else "freed"
        console.print(f"{len(gone)} {verb}, {_human(sum(e.size for e in gone))} {freed}")
