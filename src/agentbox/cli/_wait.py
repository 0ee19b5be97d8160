"""``agentbox wait ID…`` and ``agentbox watch ID``: follow tasks that run elsewhere.

Both read through :class:`agentbox.cli._client.Tasks`: the launcher service when one
answers (riding through its restarts: "launcher restarting…", then on), else the
shared state as root. A task whose launcher is gone is settled by the launcher
service, started on demand, so neither waits forever on a task nothing runs.

``wait``'s exit code says how the tasks ended (the worst of them):

====  ==========================================
0     every task is ``done``
1     a task ``failed``
5     a task ``timed_out`` (its deadline)
6     a task was ``cancelled``
7     ``--timeout`` passed with a task unfinished
====  ==========================================
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from agentbox.cli._client import Tasks
from agentbox.cli._follow import PageTail, follow, quiet_print
from agentbox.cli._view import console, dump, err, print_diff, report_text, safe
from agentbox.config import load_settings
from agentbox.core.paths import validate_task_id
from agentbox.launcher.api import TaskInfo

#: ``wait``'s exit code per final status (the worst task's wins).
EXIT_CODES = {"done": 0, "failed": 1, "timed_out": 5, "cancelled": 6}
#: ``wait``'s exit code when ``--timeout`` passed first.
WAIT_TIMEOUT = 7
#: Which status decides when tasks ended differently: failed, then timed_out, cancelled.
_WORST = ("failed", "timed_out", "cancelled", "done")


def exit_code(statuses: list[str]) -> int:
    """The exit code for tasks that ended in ``statuses`` (the worst one decides)."""
    for status in _WORST:
        if status in statuses:
            return EXIT_CODES[status]
    return 0


def register(app: typer.Typer) -> None:
    """Add ``wait`` and ``watch`` to the CLI."""

    @app.command("wait")
    def wait(
        task_ids: Annotated[list[str], typer.Argument(help="The tasks to wait for.")],
        timeout: float | None = typer.Option(
            None, "--timeout", min=0, help="Give up after this many seconds (exit 7)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the tasks as JSON."),
    ) -> None:
        """Wait until the tasks finish; exit 0 done, 1 failed, 5 timed out, 6 cancelled,
        7 --timeout passed first."""
        ids = [validate_task_id(t) for t in task_ids]
        say = (lambda m: None) if as_json else (lambda m: quiet_print(err, safe(m)))
        tasks = Tasks(load_settings(), say=say)
        end = None if timeout is None else time.monotonic() + timeout
        try:
            infos = {i: tasks.get(i) for i in ids}
            for v in infos.values():
                if not v.terminal:
                    say(f"waiting for {v.id} ({v.status})")
            while not all(info.terminal for info in infos.values()):
                if end is not None and time.monotonic() >= end:
                    break
                time.sleep(0.5)
                infos = {i: (v if v.terminal else tasks.get(i)) for i, v in infos.items()}
        finally:
            tasks.close()
        pending = [i for i, v in infos.items() if not v.terminal]
        code = WAIT_TIMEOUT if pending else exit_code([v.status for v in infos.values()])
        if as_json:
            dump({"tasks": [v.model_dump(mode="json") for v in infos.values()], "exit_code": code})
        else:
            for v in infos.values():
                line = f"{v.id} {v.status}" + (f": {v.error}" if v.error else "")
                quiet_print(console, safe(line), soft_wrap=True)
            if pending:
                quiet_print(err, safe(f"still unfinished after {timeout:g}s: {' '.join(pending)}"))
        raise typer.Exit(code)

    @app.command("watch")
    def watch(
        task_id: Annotated[str, typer.Argument(help="The task to follow.")],
        no_diff: bool = typer.Option(False, "--no-diff", help="Do not print the diff at the end."),
    ) -> None:
        """Follow a task live, then print its report; Ctrl-C stops watching, not the task."""
        tid = validate_task_id(task_id)
        settings = load_settings()
        tasks = Tasks(settings, say=lambda m: quiet_print(err, safe(m)))
        try:
            from agentbox.gateway.registry import scripted_note

            if (note := scripted_note(tasks.get(tid).model, settings)) is not None:
                quiet_print(err, safe(note), soft_wrap=True)
            tail = PageTail(lambda since: tasks.call("transcript", tid, since=since, limit=200))
            try:
                info: TaskInfo = follow(
                    lambda: tasks.get(tid), tail, live=console.is_terminal, events=True
                )
            except KeyboardInterrupt:
                quiet_print(err, safe(f"stopped watching; task {tid} goes on"))
                raise typer.Exit(130) from None
            res = tasks.call("result", tid)
        finally:
            tasks.close()
        report_text(info, res)
        if not no_diff:
            print_diff(res)
        raise typer.Exit(exit_code([info.status]))
