"""What the task commands print: the progress line, the report, the diff.

Shared by ``run``, ``show``, ``wait``, ``watch``, ``resume`` and ``diff``.
Everything the agent could have written (its final message, the diff, file
names, log lines, the task text, report fields) is printed through
:func:`safe`: control characters as visible escapes (:mod:`agentbox.core.text`),
as a :class:`~rich.text.Text`, never parsed as rich markup; on a terminal or
piped alike. Paths that run code when the branch is opened or merged are
listed above the diff.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Group
from rich.spinner import Spinner
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from agentbox.cli._env import env_rows, setup_tail
from agentbox.cli._table import print_table
from agentbox.collect.report import tests_line
from agentbox.core.console import console as make_console
from agentbox.core.text import visible
from agentbox.launcher.api import NO_CHANGES, TaskInfo, TaskResult

console = make_console()
err = make_console(stderr=True)

STYLE = {
    "queued": "dim",
    "running": "cyan",
    "collecting": "blue",
    "done": "green",
    "failed": "red",
    "timed_out": "yellow",
    "cancelled": "magenta",
}


def safe(text: object, style: str = "") -> Text:
    """Untrusted text as printable plain text: controls escaped, no markup, no emoji codes."""
    return Text(visible(str(text)), style=style)


def elapsed(info: TaskInfo, *, since_submit: bool = False) -> float:
    start = info.created_at if since_submit else (info.started_at or info.created_at)
    end = info.finished_at or time.time()
    return max(0.0, end - start)


def progress_line(
    info: TaskInfo, spinner: Spinner | None = None, current: str = "", *, static: bool = False
) -> Group:
    """The status, time, tokens and phase of a task; with a spinner unless ``static``
    (a one-off print, as ``show`` makes: a spinner there would claim something moves)."""
    t = info.tokens
    pct = 100.0 * t.total / info.budget if info.budget else 0.0
    text = Text.assemble(
        (f"{info.status:<10}", STYLE.get(info.status, "")),
        f" {elapsed(info, since_submit=True):6.1f}s",
        f"  tokens in {t.input:,} · out {t.output:,} · cache {t.cache_read + t.cache_creation:,}",
        f"  ({pct:.2f}% of {info.budget:,})",
        (f"  · {visible(info.phase[:70])}" if info.phase and not info.terminal else "", "dim"),
        (f"\n  running {current}" if current and not info.terminal else "", "cyan"),
    )
    if static:
        return Group(text)
    if spinner is None:
        return Group(Spinner("dots", text=text))
    spinner.update(text=text)
    return Group(spinner)


def report_text(info: TaskInfo, res: TaskResult) -> None:
    rep = res.report
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    style = STYLE.get(info.status, "")
    table.add_row("task", safe(info.id))
    table.add_row("status", safe(info.status, style))
    if rep.get("agent_ran") is not False and "last_test_command" in rep:
        ltc = rep.get("last_test_command")
        failed = isinstance(ltc, dict) and ltc.get("exit_code") not in (0, None)
        color = "red" if failed else ("yellow" if not ltc else "green")
        table.add_row("tests", safe(tests_line(ltc), color))
    tools_run = rep.get("tools_run")
    if isinstance(tools_run, dict) and tools_run:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(tools_run.items())[:20])
        table.add_row("tools run", safe(f"{runs} (agentbox logs {info.id})"))
    if info.error:
        table.add_row("why", safe(info.error))
    table.add_row("exit code", exit_code_words(info.exit_code))
    table.add_row("model", safe(info.model))
    if isinstance(note := rep.get("model_note"), str):
        table.add_row("", safe(note, "yellow"))
    if info.backend:
        table.add_row("sandbox", safe(sandbox_words(info.backend, info.runtime)))
    table.add_row("time", time_words(info, rep))
    t = info.tokens
    table.add_row(
        "tokens",
        f"in {t.input:,} · out {t.output:,} · cache write {t.cache_creation:,} · "
        f"cache read {t.cache_read:,} (budget {info.budget:,})",
    )
    from agentbox.gateway import format_usd

    table.add_row("cost", format_usd(t.cost_usd))
    from agentbox.observe.resources import resources_words

    if (used := resources_words(rep.get("resources") or info.resources)) is not None:
        table.add_row("resources", used)
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
            safe(" · ".join(f"{k} {v}" for k, v in stat.items() if isinstance(v, int | str))),
        )
    untracked = rep.get("untracked_note")
    if isinstance(untracked, str):
        table.add_row("not copied", safe(untracked, "yellow"))
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
    table.add_row("branch", safe(branch))
    table.add_row("commit", safe(res.commit or "-"))
    for label, text in env_rows(rep):  # setup phase, frozen environment, egress
        table.add_row(label, safe(text))
    print_table(console, table, unwrapped=True)  # piped: a row a line, never wrapped
    tail = setup_tail(rep)
    if tail is not None:
        console.print("[bold]setup output (last lines)[/bold]")
        console.print(safe(tail.strip()[-4000:]))
    msg = rep.get("final_message")
    if isinstance(msg, str) and msg.strip():
        title = "agent's last message"
        if (info.error or "").startswith("budget exhausted"):
            # Claude Code reports the gateway's 403 as "Failed to authenticate".
            title += " (a budget refusal, whatever it says: see why)"
        console.print(f"[bold]{title}[/bold]")
        console.print(safe(msg.strip()[:4000]))
    print_flagged(rep.get("flagged"))


def exit_code_words(code: int | None) -> str:
    """``-``, ``1``, or ``137 (killed by SIGKILL)`` for a code above 128."""
    if code is None:
        return "-"
    from agentbox.core.exitwords import exit_words

    words = exit_words(code)
    return f"{code} ({words.partition(': ')[2]})" if ": " in words else str(code)


def sandbox_words(backend: str, runtime: str | None) -> str:
    """``podman (runtime runsc)``, or ``qemu`` for a backend that runs no OCI runtime."""
    return f"{backend} (runtime {runtime})" if runtime else backend


def time_words(info: TaskInfo, report: dict[str, Any]) -> str:
    """The task's time: the whole (from submission), then its setup phase and its agent
    phase, ``25.5s in all: setup 14.4s, agent 8.0s (deadline 3600s)``; the rest of the
    whole is copying, starting and collecting."""
    whole = f"{elapsed(info, since_submit=True):.1f}s"
    parts = []
    setup = report.get("setup")
    if isinstance(setup, dict):
        took = setup.get("duration_s")
        if setup.get("cache") == "hit":
            parts.append("setup cached")
        elif isinstance(took, int | float) and not isinstance(took, bool):
            parts.append(f"setup {took:.1f}s")
    if info.started_at is not None:
        parts.append(f"agent {elapsed(info):.1f}s")
    phases = f" in all: {', '.join(parts)}" if parts else ""
    return f"{whole}{phases} (deadline {info.deadline:g}s)"


def print_flagged(flagged: object) -> None:
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
            console.print(safe(line, "yellow"), soft_wrap=True)


def print_diff(res: TaskResult) -> None:
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
            safe(f"(diff truncated; full: git diff in {res.shadow_git})", "yellow"), soft_wrap=True
        )


def dump(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
