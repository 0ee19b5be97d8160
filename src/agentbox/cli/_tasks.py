"""Task commands: ``tasks``, ``show``, ``cancel``, ``logs``.

They read and write the SQLite state every launcher on this host shares, so they
work on tasks of any launcher (the CLI runs as root). ``run``/``resume`` are in
:mod:`agentbox.cli._run`, ``wait``/``watch`` in :mod:`agentbox.cli._wait`,
``diff``/``apply`` in :mod:`agentbox.cli._diff`, ``launcher serve``/``stop`` in
:mod:`agentbox.cli._launcher`; what they all print is in
:mod:`agentbox.cli._view`.

A task whose launcher is gone (a ``run`` killed outright) is never shown as if it
ran: ``show`` has the launcher service settle it (started on demand; a starting
launcher reconciles every task whose owner died), and says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import RenderableType

from agentbox.cli._client import ensure_service, in_process
from agentbox.cli._table import Col, fit_table, print_table
from agentbox.cli._view import (
    STYLE,
    console,
    dump,
    elapsed,
    err,
    print_diff,
    progress_line,
    report_text,
    safe,
)
from agentbox.launcher.api import TaskInfo

_STATUS_HELP = f"Only tasks in this status ({', '.join(STYLE)}); repeatable."


def register(app: typer.Typer) -> None:
    """Add the task commands to ``app``."""

    @app.command("tasks")
    def tasks(
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        repo: str | None = typer.Option(
            None, "--repo", help="Only this repo's tasks (its path, or its directory name)."
        ),
        status: Annotated[list[str] | None, typer.Option("--status", help=_STATUS_HELP)] = None,
    ) -> None:
        """List tasks, newest first (running ones with their live token counts)."""
        bad = [x for x in status or [] if x not in STYLE]
        if bad:
            raise typer.BadParameter(
                f"{bad[0]!r:.40} is not a status (one of {', '.join(STYLE)})",
                param_hint="--status",
            )
        launcher = in_process(1)
        infos = _filter_tasks(launcher.list(), repo=repo, status=status)
        if as_json:
            dump({"tasks": [i.model_dump(mode="json") for i in infos]})
            return
        cols = [
            Col("id", keep=True), Col("status", keep=True), Col("tokens", keep=True),
            Col("cost"), Col("repo"), Col("created"), Col("time"), Col("task", ratio=1),
            Col("model"), Col("branch"),
        ]  # fmt: skip
        rows: list[list[RenderableType]] = [
            [
                safe(i.id),
                safe(i.status, STYLE.get(i.status, "")),
                f"{i.tokens.total:,}",
                _usd(i.tokens.cost_usd),
                safe(_short_repo(i.repo, launcher.settings.repos_root)),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created_at)),
                f"{elapsed(i):.0f}s",
                safe(i.task.splitlines()[0][:60] if i.task.strip() else ""),
                safe(i.model),
                safe(i.branch or ("(no changes)" if i.changed is False else "")),
            ]
            for i in infos
        ]
        print_table(console, fit_table(console, cols, rows))

    @app.command("show")
    def show(
        task_id: str = typer.Argument(...),
        as_json: bool = typer.Option(False, "--json"),
        no_diff: bool = typer.Option(False, "--no-diff"),
    ) -> None:
        """Show a task's report and diff; for a best-of-N GROUP, its attempts compared."""
        launcher = in_process(1)
        if not launcher.store.exists(task_id) and launcher.store.group(task_id):
            from agentbox.cli._attempts import print_group

            print_group(launcher.group_view(task_id), as_json=as_json)
            return
        info = launcher.get(task_id)
        if not info.terminal:
            info = _settle_if_orphaned(launcher, info, quiet=as_json)
        if not info.terminal:
            if as_json:
                dump({"task": info.model_dump(mode="json")})
            else:
                console.print(progress_line(info, static=True))
            return
        res = launcher.result(task_id)
        if as_json:
            dump({"task": info.model_dump(mode="json"), "result": res.model_dump(mode="json")})
            return
        report_text(info, res)
        if not no_diff:
            print_diff(res)

    @app.command("cancel")
    def cancel(task_id: str = typer.Argument(...)) -> None:
        """Cancel a task (its partial result is still collected)."""
        launcher = in_process(1)
        before = launcher.get(task_id)
        if before.terminal:
            done = f"{before.id} had already finished ({before.status}): nothing to cancel"
            err.print(safe(done))
            raise typer.Exit(1)
        info = launcher.cancel(task_id)
        if info.terminal:
            # Queued: cancelled at once. Running: its runner stopped it and recorded the end
            # before the cancel returned (a fast stop), so say what it was.
            was = "" if before.status == "queued" else f" (was {before.status})"
            console.print(safe(f"{info.id}: {info.status}{was}"))
            return
        # Its runner stops it (a running sandbox is killed), collects what it wrote and
        # then records the end: "queued" or "running" here would read as ignored. "was":
        # the status the cancel found (by the time it returns, the runner may be collecting).
        console.print(
            safe(
                f"{info.id}: cancelling (was {before.status}); agentbox wait {info.id} for its end"
            ),
            soft_wrap=True,
        )

    @app.command("logs")
    def logs(
        task_id: str = typer.Argument(...),
        follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until done."),
        as_json: bool = typer.Option(
            False, "--json", help="The transcript as JSON (with -f: one event a line)."
        ),
        full: bool = typer.Option(
            False, "--full", help="Every line of every tool's output (default: the last lines)."
        ),
    ) -> None:
        """What the agent ran and what came back: launcher phases, each tool call with
        its result, the agent's messages, gateway refusals, with times."""
        from agentbox.cli._logs import follow_logs, print_logs
        from agentbox.core.paths import TaskPaths

        launcher = in_process(1)
        info = launcher.get(task_id)
        root = TaskPaths(launcher.settings.data_dir, info.id).root
        if follow and not info.terminal:
            follow_logs(console, root, created_at=info.created_at, full=full, as_json=as_json,
                        finished=lambda: bool(launcher.get(task_id).terminal))  # fmt: skip
        else:
            print_logs(console, root, created_at=info.created_at, full=full, as_json=as_json)


def _short_repo(repo: str, root: Path) -> str:
    """A repo as a path below the repos root (the whole path when it is not below it)."""
    p = Path(repo)
    return str(p.relative_to(root)) if p.is_relative_to(root) and p != root else repo


def _filter_tasks(
    infos: list[TaskInfo], *, repo: str | None, status: list[str] | None
) -> list[TaskInfo]:
    if status:
        infos = [i for i in infos if i.status in status]
    if repo:
        if "/" in repo:
            want = str(Path(repo).expanduser().absolute())
            infos = [i for i in infos if i.repo.rstrip("/") == want.rstrip("/")]
        else:
            infos = [i for i in infos if Path(i.repo).name == repo]
    return infos


def _settle_if_orphaned(launcher: Any, info: TaskInfo, *, quiet: bool) -> TaskInfo:
    """A task whose launcher is gone is handed to the launcher service (started on
    demand: a starting launcher re-adopts every task whose owner died, or settles it);
    the task as it is then is returned. One whose launcher lives is returned as it is."""
    row = launcher.store.get(info.id)
    if row.owner is not None and row.owner.alive():
        return info
    who = f"pid {row.owner.pid}" if row.owner is not None else "unknown"

    def say(m: str) -> None:
        if not quiet:
            err.print(safe(m))

    say(f"task {info.id} is {info.status} but its launcher ({who}) is gone; "
        "the launcher service takes it over")  # fmt: skip
    ensure_service(launcher.settings, say=say).close()
    row = launcher.store.get(info.id)
    if not row.info().terminal and (row.owner is None or not row.owner.alive()):
        say(
            f"task {info.id}: a launcher service was already running and did not take it "
            "over; restart it (agentbox launcher serve) to settle it"
        )
    now: TaskInfo = launcher.get(info.id)
    return now


def _usd(cost: float | None) -> str:
    """A task's cost for the table ("?" when its model has no price)."""
    from agentbox.gateway import format_usd

    return format_usd(cost) if cost is not None else "?"
