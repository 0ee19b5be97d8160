"""Task commands: ``run``, ``tasks``, ``show``, ``cancel``, ``logs``, ``launcher serve``.

``agentbox run`` drives an in-process :class:`~agentbox.launcher.Launcher`
(the CLI runs as root, like the launcher); the other commands read and write
the same SQLite state, so they work on tasks of any launcher on this host.

Everything the agent could have written (its final message, the diff, file
names, log lines, the task text, report fields) is printed through
:func:`_safe`: control characters as visible escapes (:mod:`agentbox._text`),
as a :class:`~rich.text.Text`, never parsed as rich markup; on a terminal or
piped alike. Paths that run code when the branch is opened or merged are
listed above the diff.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from agentbox._text import visible
from agentbox.boxfile import load_boxfile
from agentbox.cli._env import env_rows, setup_tail
from agentbox.cli._table import Col, fit_table, print_table
from agentbox.collect.report import tests_line
from agentbox.config import load_settings
from agentbox.errors import PolicyRefused
from agentbox.launcher.api import NO_CHANGES, TaskInfo, TaskRequest, TaskResult
from agentbox.paths import validate_task_id

__all__ = ["register"]

console = Console()
err = Console(stderr=True)

_STYLE = {
    "queued": "dim",
    "running": "cyan",
    "collecting": "blue",
    "done": "green",
    "failed": "red",
    "timed_out": "yellow",
    "cancelled": "magenta",
}


_STATUS_HELP = f"Only tasks in this status ({', '.join(_STYLE)}); repeatable."


def _safe(text: object, style: str = "") -> Text:
    """Untrusted text as printable plain text: controls escaped, no markup, no emoji codes."""
    return Text(visible(str(text)), style=style)


def _launcher(max_tasks: int = 4) -> Any:
    from agentbox.launcher import Launcher

    return Launcher(load_settings(), max_tasks=max_tasks)


def _elapsed(info: TaskInfo, *, since_submit: bool = False) -> float:
    start = info.created_at if since_submit else (info.started_at or info.created_at)
    end = info.finished_at or time.time()
    return max(0.0, end - start)


def _progress_line(info: TaskInfo, spinner: Spinner | None = None, current: str = "") -> Group:
    t = info.tokens
    pct = 100.0 * t.total / info.budget if info.budget else 0.0
    text = Text.assemble(
        (f"{info.status:<10}", _STYLE.get(info.status, "")),
        f" {_elapsed(info, since_submit=True):6.1f}s",
        f"  tokens in {t.input:,} · out {t.output:,} · cache {t.cache_read + t.cache_creation:,}",
        f"  ({pct:.2f}% of {info.budget:,})",
        (f"  · {visible(info.phase[:70])}" if info.phase and not info.terminal else "", "dim"),
        (f"\n  running {current}" if current and not info.terminal else "", "cyan"),
    )
    if spinner is None:
        return Group(Spinner("dots", text=text))
    spinner.update(text=text)
    return Group(spinner)


def _report_text(info: TaskInfo, res: TaskResult) -> None:
    rep = res.report
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    style = _STYLE.get(info.status, "")
    table.add_row("task", _safe(info.id))
    table.add_row("status", _safe(info.status, style))
    if rep.get("agent_ran") is not False and "last_test_command" in rep:
        ltc = rep.get("last_test_command")
        failed = isinstance(ltc, dict) and ltc.get("exit_code") not in (0, None)
        color = "red" if failed else ("yellow" if not ltc else "green")
        table.add_row("tests", _safe(tests_line(ltc), color))
    tools_run = rep.get("tools_run")
    if isinstance(tools_run, dict) and tools_run:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(tools_run.items())[:20])
        table.add_row("tools run", _safe(f"{runs} (agentbox logs {info.id})"))
    if info.error:
        table.add_row("why", _safe(info.error))
    table.add_row("exit code", str(info.exit_code) if info.exit_code is not None else "-")
    table.add_row("model", _safe(info.model))
    table.add_row("time", f"{_elapsed(info):.1f}s (deadline {info.deadline:g}s)")
    t = info.tokens
    table.add_row(
        "tokens",
        f"in {t.input:,} · out {t.output:,} · cache write {t.cache_creation:,} · "
        f"cache read {t.cache_read:,} (budget {info.budget:,})",
    )
    stat = rep.get("diffstat")
    if info.changed is False and info.status == "done":
        table.add_row("changes", f"[yellow]{NO_CHANGES}[/]")
    elif info.changed is False:
        # A failed task that changed nothing: why it failed says it, not "no changes".
        table.add_row("changes", "none")
    elif info.changed is None and rep.get("agent_ran") is False:
        table.add_row("changes", "none: the agent never started (see why)")
    elif isinstance(stat, dict):
        table.add_row(
            "changes",
            _safe(" · ".join(f"{k} {v}" for k, v in stat.items() if isinstance(v, int | str))),
        )
    skipped = rep.get("skipped")
    if isinstance(skipped, list) and skipped:
        table.add_row("skipped", f"{len(skipped)} entries (see agentbox show --json)")
    branch = res.branch or ("none" if not info.changed else "(not published)")
    if not res.branch and info.changed:
        # A refused publish (a branch of the user's own by that name) says why.
        why = [n.get("reason") for n in rep.get("notes") or []
               if isinstance(n, dict) and n.get("path") == f"agentbox/{info.id}"]  # fmt: skip
        if why and isinstance(why[-1], str):
            branch = f"(not published: {why[-1]})"
    table.add_row("branch", _safe(branch))
    table.add_row("commit", _safe(res.commit or "-"))
    for label, text in env_rows(rep):  # setup phase, frozen environment, egress
        table.add_row(label, _safe(text))
    print_table(console, table)
    tail = setup_tail(rep)
    if tail is not None:
        console.print("[bold]setup output (last lines)[/bold]")
        console.print(_safe(tail.strip()[-4000:]))
    msg = rep.get("final_message")
    if isinstance(msg, str) and msg.strip():
        title = "agent's last message"
        if (info.error or "").startswith("budget exhausted"):
            # Claude Code reports the gateway's 403 as "Failed to authenticate".
            title += " (a budget refusal, whatever it says: see why)"
        console.print(f"[bold]{title}[/bold]")
        console.print(_safe(msg.strip()[:4000]))
    _print_flagged(rep.get("flagged"))


def _print_flagged(flagged: object) -> None:
    """The paths that run code when the branch is opened or merged (shown above the diff)."""
    if not isinstance(flagged, list) or not flagged:
        return
    console.print(
        Text(
            f"WARNING: {len(flagged)} path(s) in this result make other tools run code when "
            "the branch is opened, checked out or merged; review them before you do:",
            style="bold yellow",
        )
    )
    for f in flagged[:200]:
        if isinstance(f, dict):
            line = f"  {f.get('change', '?')} {f.get('path', '?')}: {f.get('reason', '')}"
            console.print(_safe(line, "yellow"), soft_wrap=True)


def _print_diff(res: TaskResult) -> None:
    if not res.diff.strip():
        if res.changed is False and res.status == "done":
            console.print("[dim](no changes)[/dim]")
        return
    # File contents are the agent's: escape sequences in them must not reach the terminal
    # (OSC 52 clipboard, OSC 8 links, CSI 2J), whether it is a terminal or a pipe.
    diff = visible(res.diff)
    if console.is_terminal:
        console.print(
            Syntax(diff, "diff", theme="ansi_dark", background_color="default", word_wrap=True)
        )
    else:  # piped: the diff as git printed it, never cut to a console width
        sys.stdout.write(diff if diff.endswith("\n") else diff + "\n")
        sys.stdout.flush()
    if res.diff_truncated:
        console.print(
            _safe(f"(diff truncated; full: git diff in {res.shadow_git})", "yellow"), soft_wrap=True
        )


def _dump(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def register(app: typer.Typer) -> None:
    """Add the task commands to ``app``."""

    @app.command("run")
    def run(
        repo: Annotated[Path, typer.Option("--repo", help="The git repo (inside the repos root).")],
        task: Annotated[
            str | None,
            typer.Argument(help="What the agent should do; '-' reads it from stdin."),
        ] = None,
        model: str | None = typer.Option(None, "--model", help="A model from `agentbox models`."),
        budget: int | None = typer.Option(None, "--budget", help="Token budget (default 20M)."),
        deadline: float | None = typer.Option(None, "--deadline", help="Seconds (10..86400)."),
        boxfile: Annotated[
            Path | None, typer.Option("--boxfile", help="A Boxfile for the sandbox.")
        ] = None,
        include_uncommitted: bool = typer.Option(
            False, "--include-uncommitted", help="Copy uncommitted changes too."
        ),
        task_id: str | None = typer.Option(None, "--id", help="Task id (default: generated)."),
        no_publish: bool = typer.Option(
            False, "--no-publish", help="Keep the result in the shadow git dir only."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        task_file: Annotated[
            Path | None,
            typer.Option("--task-file", help="Read the task from this file ('-': stdin)."),
        ] = None,
        backend: str | None = typer.Option(
            None, "--backend", help="podman, docker, qemu, firecracker (overrides the Boxfile)."
        ),
    ) -> None:
        """Delegate TASK to Claude Code in a sandbox; print the report and the branch's diff."""
        task = _task_text(task, task_file)
        box = load_boxfile(boxfile, load_settings()) if boxfile is not None else None
        if box is not None and box.image_build is not None:
            # [image] containerfile = …: built here (cached), never by the launcher.
            from agentbox.image import build_for_boxfile

            box = build_for_boxfile(load_settings(), box)
        if backend is not None:
            from agentbox.boxfile import Boxfile

            base = box if box is not None else Boxfile.from_dict({}, settings=load_settings())
            Boxfile.from_dict({"backend": backend})  # the name checked like a Boxfile's
            box = base.model_copy(update={"backend": backend})
        if task_id is not None:
            validate_task_id(task_id)
        try:
            req = TaskRequest(
                repo=str(repo.expanduser().absolute()),
                task=task,
                model=model,
                budget=budget,
                deadline=deadline,
                task_id=task_id,
                include_uncommitted=include_uncommitted,
                publish=not no_publish,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise PolicyRefused(f"{where}: {first['msg']}") from exc
        from agentbox._reap import exit_on_signals

        launcher = _launcher()
        # TERM, HUP, … act like Ctrl-C (cancel, collect the partial result); a SIGKILL
        # is answered by the task's watchdog, which reaps the sandbox and the gateway.
        with exit_on_signals():
            try:
                launcher.reconcile()
                info = launcher.submit(req, boxfile=box)
                info = _follow(
                    launcher, info.id, live=not as_json and console.is_terminal,
                    events=not as_json,
                )  # fmt: skip
            except KeyboardInterrupt:
                launcher.shutdown()  # interrupted before _follow took over: cancel, collect
                raise
            finally:
                launcher.close()
        res = launcher.result(info.id)
        if as_json:
            _dump({"task": info.model_dump(mode="json"), "result": res.model_dump(mode="json")})
        else:
            _report_text(info, res)
            _print_diff(res)
        raise typer.Exit(0 if info.status == "done" else 1)

    @app.command("tasks")
    def tasks(
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        repo: str | None = typer.Option(
            None, "--repo", help="Only this repo's tasks (its path, or its directory name)."
        ),
        status: Annotated[list[str] | None, typer.Option("--status", help=_STATUS_HELP)] = None,
    ) -> None:
        """List tasks, newest first (running ones with their live token counts)."""
        bad = [x for x in status or [] if x not in _STYLE]
        if bad:
            raise typer.BadParameter(
                f"{bad[0]!r:.40} is not a status (one of {', '.join(_STYLE)})",
                param_hint="--status",
            )
        launcher = _launcher(1)
        infos = _filter_tasks(launcher.list(), repo=repo, status=status)
        if as_json:
            _dump({"tasks": [i.model_dump(mode="json") for i in infos]})
            return
        cols = [
            Col("id", keep=True), Col("status", keep=True), Col("tokens", keep=True),
            Col("repo"), Col("created"), Col("time"), Col("task", ratio=1),
            Col("model"), Col("branch"),
        ]  # fmt: skip
        rows: list[list[RenderableType]] = [
            [
                _safe(i.id),
                _safe(i.status, _STYLE.get(i.status, "")),
                f"{i.tokens.total:,}",
                _safe(_short_repo(i.repo, launcher.settings.repos_root)),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created_at)),
                f"{_elapsed(i):.0f}s",
                _safe(i.task.splitlines()[0][:60] if i.task.strip() else ""),
                _safe(i.model),
                _safe(i.branch or ("(no changes)" if i.changed is False else "")),
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
        """Show a task's report and diff."""
        launcher = _launcher(1)
        info = launcher.get(task_id)
        if not info.terminal:
            if as_json:
                _dump({"task": info.model_dump(mode="json")})
            else:
                console.print(_progress_line(info))
            return
        res = launcher.result(task_id)
        if as_json:
            _dump({"task": info.model_dump(mode="json"), "result": res.model_dump(mode="json")})
            return
        _report_text(info, res)
        if not no_diff:
            _print_diff(res)

    @app.command("cancel")
    def cancel(task_id: str = typer.Argument(...)) -> None:
        """Cancel a task (its partial result is still collected)."""
        launcher = _launcher(1)
        before = launcher.get(task_id)
        if before.terminal:
            done = f"{before.id} had already finished ({before.status}): nothing to cancel"
            err.print(_safe(done))
            raise typer.Exit(1)
        info = launcher.cancel(task_id)
        console.print(_safe(f"{info.id}: {info.status}"))

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
        from agentbox.paths import TaskPaths

        launcher = _launcher(1)
        info = launcher.get(task_id)
        root = TaskPaths(launcher.settings.data_dir, info.id).root
        if follow and not info.terminal:
            follow_logs(console, root, created_at=info.created_at, full=full, as_json=as_json,
                        finished=lambda: bool(launcher.get(task_id).terminal))  # fmt: skip
        else:
            print_logs(console, root, created_at=info.created_at, full=full, as_json=as_json)

    launcher_app = typer.Typer(help="The privileged launcher service.", no_args_is_help=True)

    @launcher_app.command("serve")
    def serve(
        max_tasks: int = typer.Option(4, "--max-tasks", min=1, max=64),
    ) -> None:
        """Serve the launcher's API on <data_dir>/launcher.sock (used by the MCP server)."""
        from agentbox.launcher import serve as _serve

        launcher = _launcher(max_tasks)
        # Announced only once bound: a refused start (another launcher) prints no address.
        _serve(launcher, on_listening=lambda p: err.print(f"launcher listening on {p}"))

    app.add_typer(launcher_app, name="launcher")


#: The most task text read from a file or stdin (the launcher caps it lower still).
_MAX_TASK_BYTES = 1 << 20


def _task_text(task: str | None, task_file: Path | None) -> str:
    """The task from the argument, ``--task-file PATH`` or stdin (``-`` for either)."""
    if task is not None and task_file is not None:
        raise typer.BadParameter("give the task as an argument or --task-file, not both")
    if task is None and task_file is None:
        raise typer.BadParameter(
            "what should the agent do? Give TASK, '-' (stdin) or --task-file PATH",
            param_hint="TASK",
        )
    if task is not None and task != "-":
        return task
    try:
        if task == "-" or str(task_file) == "-":
            raw = sys.stdin.buffer.read(_MAX_TASK_BYTES + 1)
            where = "stdin"
        else:
            assert task_file is not None
            with task_file.expanduser().open("rb") as fh:
                raw = fh.read(_MAX_TASK_BYTES + 1)
            where = str(task_file)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot read {task_file}: {exc.strerror}", param_hint="--task-file"
        ) from exc
    if len(raw) > _MAX_TASK_BYTES:
        raise typer.BadParameter(f"the task in {where} is over {_MAX_TASK_BYTES} bytes")
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        raise typer.BadParameter(f"the task read from {where} is empty")
    return text


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


def _follow(launcher: Any, task_id: str, *, live: bool, events: bool = False) -> TaskInfo:
    """Wait for the task; Ctrl-C cancels it. ``live`` (a terminal): a spinner with the
    status, time, tokens and the tool call in flight, the events printed above it.
    ``events`` without ``live`` (piped, CI): the task id at once, then one line per event."""
    from agentbox.cli._logs import EventTail
    from agentbox.paths import TaskPaths

    try:
        if not live and not events:
            info: TaskInfo = launcher.wait(task_id)
            return info
        info = launcher.get(task_id)
        tail = EventTail(TaskPaths(launcher.settings.data_dir, info.id).root, info.created_at)
        if not live:
            err.print(_safe(f"task {info.id} {info.status} (agentbox logs {info.id})"))
            while True:
                info = launcher.get(task_id)
                for line in tail.new_lines():
                    err.print(line, soft_wrap=True)
                if info.terminal:
                    return info
                time.sleep(0.5)
        spinner = Spinner("dots")
        with Live(_progress_line(info, spinner), console=err, refresh_per_second=8) as lv:
            polls = 0
            while True:
                info = launcher.get(task_id)
                if polls % 4 == 0 or info.terminal:  # the transcript about once a second
                    for line in tail.new_lines():
                        lv.console.print(line, soft_wrap=True)
                polls += 1
                lv.update(_progress_line(info, spinner, tail.current))
                if info.terminal:
                    return info
                time.sleep(0.25)
    except KeyboardInterrupt:
        err.print("[magenta]cancelling; collecting the partial result…[/magenta]")
        launcher.cancel(task_id)
        done: TaskInfo = launcher.wait(task_id)
        return done
