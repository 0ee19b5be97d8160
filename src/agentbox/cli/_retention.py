"""Retention commands: ``agentbox rm``, ``agentbox prune``, ``agentbox du``.

They work on the data dir and its ``state.db`` directly, like ``tasks`` and
``show`` (as root, like the launcher); see :mod:`agentbox.launcher._retention`
for what is removed and what never is (a branch in the user's repo, a task
that may still run).
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from agentbox.cli._table import Col, fit_table, print_table
from agentbox.config import Settings, load_settings
from agentbox.core.console import console as make_console
from agentbox.errors import AgentboxError
from agentbox.launcher import Removal, Store, data_usage, parse_age, prune, remove_task

console = make_console(highlight=False)

KeepBranches = typer.Option(
    False,
    "--keep-branches",
    help="Keep the result (shadow git branch, report, record) of tasks whose result was "
    "never published, so `agentbox publish` still works; the rest of them goes.",
)
DryRun = typer.Option(False, "--dry-run", "-n", help="Say what would go; remove nothing.")


def human(n: float) -> str:
    """Bytes as a short human figure (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _line(r: Removal, dry_run: bool) -> str:
    """What went and what stays, for every kind of task: one with no changes, one whose
    result a branch of its repo holds (published, fetched by MCP, merged), one whose
    result only agentbox held (kept or lost), a task dir without a record."""
    verb = "would remove" if dry_run else "removed"
    text = f"{verb} {r.task_id} ({human(r.bytes)})"
    if r.repo is None:
        return text  # a leftover dir without a record
    short = (r.commit or "")[:12]
    if r.kept_result:
        text += (
            f": its workspace and logs; kept its unpublished result (in no branch of "
            f"{r.repo}), report and record: agentbox publish {r.task_id}"
        )
        return text
    text += ": its workspace, shadow git dir, logs and record"
    if r.in_repo:
        held = f" (its result, commit {short})" if short else " (its result)"
        text += f"; branch {', '.join(r.in_repo)}{held} stays in its repo {r.repo}"
    elif r.lost_result:
        gone = (
            f"branch {r.branch} is no longer in {r.repo} and no other branch there holds it"
            if r.branch
            else f"no branch of {r.repo} holds it"
        )
        which = f" (commit {short})" if short else ""
        text += f"; its unpublished result went with it{which}: {gone}"
    elif r.changed is False:
        text += "; it changed nothing (no result)"
    else:
        text += "; it left no result"
    if r.branch and not r.in_repo and not r.lost_result:
        text += f"; branch {r.branch} stays in its repo"
    return text


def _store() -> tuple[Settings, Store]:
    settings = load_settings()
    return settings, Store(settings.data_dir / "state.db")


def register(app: typer.Typer) -> None:
    """Add ``rm``, ``prune`` and ``du`` to ``app``."""

    @app.command("rm")
    def rm(
        task_ids: Annotated[list[str], typer.Argument(help="Task ids.", metavar="ID...")],
        keep_branches: bool = KeepBranches,
        dry_run: bool = DryRun,
    ) -> None:
        """Remove finished tasks: their workspace, shadow git dir, logs and record.

        A published branch in the user's repo is never touched. A task that is
        queued, running or collecting is refused (cancel it first).
        """
        settings, store = _store()
        failed = 0
        for task_id in task_ids:
            try:
                r = remove_task(
                    settings,
                    store,
                    task_id,
                    keep_branches=keep_branches,
                    dry_run=dry_run,
                )
            except AgentboxError as exc:
                failed += 1
                typer.echo(f"{task_id[:64]!r}: not removed: {exc}", err=True)
                continue
            typer.echo(_line(r, dry_run))
        if failed:
            raise typer.Exit(3 if failed == len(task_ids) else 1)

    @app.command("prune")
    def prune_cmd(
        older_than: str = typer.Option(
            "7d", "--older-than", help="Finished longer ago than this (e.g. 7d, 12h, 30m, 2w)."
        ),
        keep_branches: bool = KeepBranches,
        dry_run: bool = DryRun,
    ) -> None:
        """Remove every task that finished more than --older-than ago (default 7 days)."""
        try:
            age = parse_age(older_than)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--older-than") from exc
        settings, store = _store()
        removed = prune(
            settings,
            store,
            older_than=age,
            keep_branches=keep_branches,
            dry_run=dry_run,
        )
        for r in removed:
            typer.echo(_line(r, dry_run))
        total = sum(r.bytes for r in removed)
        verb = "would free" if dry_run else "freed"
        typer.echo(f"{len(removed)} task(s); {verb} {human(total)}")

    @app.command("du")
    def du(as_json: bool = typer.Option(False, "--json")) -> None:
        """Show what the data dir holds: each task's parts, and everything else."""
        settings, store = _store()
        usage = data_usage(settings, store)
        if as_json:
            data = {
                "data_dir": str(usage.data_dir),
                "total": usage.total,
                "tasks": [
                    {"id": t.task_id, "status": t.status, "finished_at": t.finished_at,
                     "branch": t.branch, "total": t.total, "parts": t.parts}
                    for t in usage.tasks
                ],
                "other": usage.other,
                "orphan_task_dirs": usage.orphan_task_dirs,
            }  # fmt: skip
            typer.echo(json.dumps(data, indent=2))
            return
        cols = [
            Col("task", keep=True), Col("status", keep=True), Col("age"), Col("workspace"),
            Col("shadow.git"), Col("other"), Col("total", keep=True),
        ]  # fmt: skip
        rows = []
        now = time.time()
        for t in sorted(usage.tasks, key=lambda t: -t.total):
            age = f"{(now - t.finished_at) / 86400:.1f}d" if t.finished_at else "-"
            ws, shadow = t.parts.get("workspace", 0), t.parts.get("shadow.git", 0)
            rows.append([
                t.task_id, t.status, age, human(ws), human(shadow),
                human(t.total - ws - shadow), human(t.total),
            ])  # fmt: skip
        # Whole ids (they paste into `agentbox rm`): other columns go before an id is cut.
        print_table(console, fit_table(console, cols, rows))
        for name, size in sorted(usage.other.items(), key=lambda kv: -kv[1]):
            console.print(f"{name:<28} {human(size):>12}", markup=False)
        console.print(
            f"{'total in ' + str(usage.data_dir):<28} {human(usage.total):>12}", markup=False
        )
        if usage.orphan_task_dirs:
            console.print(
                f"{len(usage.orphan_task_dirs)} task dir(s) without a record: "
                "`agentbox prune` removes them",
                markup=False,
            )
