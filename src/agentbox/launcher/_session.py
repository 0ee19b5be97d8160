"""Continuing a finished task (``agentbox resume``, MCP ``delegate(continue_from=…)``).

A follow-up task is an ordinary task with two differences:

* its workspace starts from the previous task's **result commit** (or, when that
  task changed nothing, from its base), so its branch ``agentbox/<new>`` stacks on
  ``agentbox/<previous>``. The commit must be in the user's repo (published by the
  launcher, or fetched there by the MCP server): :func:`plan` refuses otherwise,
  before anything is created, and names ``agentbox publish``;
* the agent is told of the previous task: its task text, what it ran and what came
  back (the transcript, as text), and its last message are written to
  ``.git/agentbox/previous-task.md`` in the workspace (the agent's own ``.git``, which
  collection never reads, so the file never lands in the result), and the task
  text the agent gets starts with a paragraph naming that file.

Claude Code's own ``--resume`` is not used: its session state lives in the
sandbox's ``$HOME``, which does not outlive the sandbox, and the agent's argv is
fixed by policy (:mod:`agentbox.launcher._agent`).

The plan is recorded at submit in ``<data>/continue/<id>.json`` (0600: the task dir
does not exist yet, and only the runner may make it), moved into the task dir
when the workspace is made, and read from there for the agent's task text.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from agentbox._log import get_logger
from agentbox.config import Settings
from agentbox.errors import AgentboxError, CommandError, PolicyRefused
from agentbox.launcher._store import TaskRow
from agentbox.launcher._validate import git_readonly
from agentbox.paths import TaskPaths

__all__ = ["PREVIOUS_FILE", "Continuation", "agent_task", "base_commit", "plan", "seed"]

log = get_logger("launcher.session")

#: Where, in the workspace, the agent finds the previous task (inside its own .git).
PREVIOUS_FILE = ".git/agentbox/previous-task.md"
#: The most transcript text written for the agent.
MAX_TRANSCRIPT_CHARS = 400_000
_RECORD = "continue.json"


@dataclass(frozen=True)
class Continuation:
    """What a follow-up task continues: the previous task and the commit it starts from."""

    previous: str
    base_commit: str
    previous_status: str


def plan(
    settings: Settings, prev: TaskRow, repo: Path, *, include_uncommitted: bool
) -> Continuation:
    """Check that ``prev`` can be continued in ``repo``; refuse (nothing made) otherwise."""
    if prev.status not in ("done", "failed", "timed_out", "cancelled"):
        raise PolicyRefused(
            f"task {prev.id} is still {prev.status}: wait for it (agentbox wait {prev.id})"
        )
    if Path(prev.repo) != repo:
        raise PolicyRefused(f"task {prev.id} worked on {prev.repo}, not on {repo}")
    if include_uncommitted:
        raise PolicyRefused("a continued task starts from the previous result, not from "
                            "uncommitted changes: drop include_uncommitted")  # fmt: skip
    commit = prev.commit_id if prev.changed and prev.commit_id else _prev_base(settings, prev)
    if not commit:
        raise PolicyRefused(f"task {prev.id} left nothing to continue from (no result, no base)")
    try:
        git_readonly(repo, "cat-file", "-e", f"{commit}^{{commit}}")
    except CommandError:
        raise PolicyRefused(
            f"task {prev.id}'s result commit {commit[:12]} is not in {repo}: publish it first "
            f"(agentbox publish {prev.id})"
        ) from None
    return Continuation(previous=prev.id, base_commit=commit, previous_status=prev.status)


def _prev_base(settings: Settings, prev: TaskRow) -> str:
    try:
        doc = json.loads(TaskPaths(settings.data_dir, prev.id).report_file.read_text())
    except (OSError, ValueError):
        return ""
    base = doc.get("base_commit") if isinstance(doc, dict) else None
    return base if isinstance(base, str) else ""


def _pending(settings: Settings, task_id: str) -> Path:
    return settings.data_dir / "continue" / f"{task_id}.json"


def record(settings: Settings, task_id: str, cont: Continuation) -> None:
    """Keep the plan until the task's workspace is made (called at submit)."""
    where = _pending(settings, task_id)
    where.parent.mkdir(mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(where, flags, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(cont), fh)


def _load(path: Path) -> Continuation | None:
    try:
        doc = json.loads(path.read_text())
        return Continuation(**{k: str(doc[k]) for k in ("previous", "base_commit",
                                                        "previous_status")})  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def base_commit(settings: Settings, task_id: str) -> str:
    """The commit a task's workspace starts from: a continued task's, else ``HEAD``."""
    cont = _load(_pending(settings, task_id))
    return cont.base_commit if cont is not None else "HEAD"


def seed(settings: Settings, paths: TaskPaths) -> None:
    """After the workspace is made: move the plan into the task dir and write the previous
    task for the agent (before the workspace is given to the sandbox uid)."""
    pending = _pending(settings, paths.task_id)
    cont = _load(pending)
    if cont is None:
        return
    pending.replace(paths.root / _RECORD)
    try:
        text = _previous_text(settings, cont)
        target = paths.workspace / PREVIOUS_FILE
        target.parent.mkdir(mode=0o755, exist_ok=True)
        target.write_text(text)
    except (OSError, AgentboxError) as exc:  # the task still runs, on the right base
        log.warning("previous task not written for the agent", task_id=paths.task_id,
                    error=str(exc))  # fmt: skip


def _previous_text(settings: Settings, cont: Continuation) -> str:
    from agentbox.transcript import event_text, read_transcript

    prev = TaskPaths(settings.data_dir, cont.previous)
    report: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(prev.report_file.read_text())
        report = loaded if isinstance(loaded, dict) else {}
    t = read_transcript(prev.root)
    lines: list[str] = []
    size = 0
    for e in t.events:
        line = event_text(e, tail_lines=40)
        size += len(line) + 1
        if size > MAX_TRANSCRIPT_CHARS:
            lines.append("[… the rest of the transcript is left out: too long]")
            break
        lines.append(line)
    task = _task_of(settings, cont.previous)
    return (
        f"# The previous task: {cont.previous} ({cont.previous_status})\n\n"
        f"This workspace starts from its result (commit {cont.base_commit}).\n\n"
        f"## What it was asked\n\n{task}\n\n"
        f"## Its last message\n\n{report.get('final_message') or '(none)'}\n\n"
        f"## What it ran and what came back\n\n" + "\n".join(lines) + "\n"
    )


def _task_of(settings: Settings, task_id: str) -> str:
    from agentbox.launcher._store import Store

    try:
        return Store(settings.data_dir / "state.db").get(task_id).task
    except AgentboxError:
        return "(unknown)"


def agent_task(paths: TaskPaths, task: str) -> str:
    """The task text the agent gets: a continued task's starts by naming the previous one."""
    cont = _load(paths.root / _RECORD)
    if cont is None:
        return task
    return (
        f"This continues an earlier task ({cont.previous}, {cont.previous_status}) on this "
        f"repo: the workspace already holds its result. What it was asked, what it ran and "
        f"what came back, and its last message are in {PREVIOUS_FILE}; read that file "
        f"first.\n\nThe follow-up:\n{task}"
    )
