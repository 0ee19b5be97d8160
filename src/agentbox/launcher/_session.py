"""Continuing a finished task (``agentbox resume``, MCP ``delegate(continue_from=…)``).

A follow-up task is an ordinary task with three differences:

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

* and Claude Code resumes the previous task's **session** (``--resume <id>``, its
  own, offline): every task's Claude Code keeps its config and sessions in the
  workspace's ``.git/agentbox/claude`` (``CLAUDE_CONFIG_DIR``, see
  :mod:`agentbox.launcher._agent`), which outlives the sandbox with the task dir.
  The previous session file is read beneath the previous workspace (no link
  followed: the agent wrote that tree) and written into the new one; its id comes
  from the previous agent's ``system/init`` event and must be a UUID. Without a
  session to resume (a task that failed before its agent ran, a wrecked ``.git``)
  the follow-up still runs, with the file above.

The plan is recorded at submit in ``<data>/continue/<id>.json`` (0600: the task dir
does not exist yet, and only the runner may make it) and kept there (a requeued task
is prepared again from it); when the workspace is made, a copy saying whether the
session was carried goes into the task dir, read for the agent's argv and task text.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths
from agentbox.errors import AgentboxError, CommandError, PolicyRefused
from agentbox.launcher._agent import CLAUDE_CONFIG_IN_WORKSPACE, SESSION_ID
from agentbox.launcher._store import TaskRow
from agentbox.launcher._validate import git_readonly

log = get_logger(__name__)

#: Where, in the workspace, the agent finds the previous task (inside its own .git).
PREVIOUS_FILE = ".git/agentbox/previous-task.md"
#: The most transcript text written for the agent.
MAX_TRANSCRIPT_CHARS = 400_000
#: The largest Claude Code session file carried over.
MAX_SESSION_BYTES = 64 << 20
#: The workspace as Claude Code names it under ``projects/`` (its cwd, ``/workspace``).
PROJECT_DIR = "-workspace"
_RECORD = "continue.json"


@dataclass(frozen=True)
class Continuation:
    """What a follow-up task continues: the previous task and the commit it starts from."""

    previous: str
    base_commit: str
    previous_status: str
    session: str = ""
    """The previous Claude Code session to resume ("" when there is none to resume)."""


def plan(
    settings: Settings, prev: TaskRow | None, repo: Path, include_uncommitted: bool
) -> Continuation | None:
    """Check that ``prev`` can be continued in ``repo``; refuse (nothing made) otherwise.
    None for a task that continues nothing (``prev`` None)."""
    if prev is None:
        return None
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
    return Continuation(
        previous=prev.id,
        base_commit=commit,
        previous_status=prev.status,
        session=session_id_of(TaskPaths(settings.data_dir, prev.id)),
    )


def session_id_of(prev: TaskPaths) -> str:
    """The previous agent's session id, from Claude Code's ``system/init`` event ("" if none)."""
    try:
        with (prev.log_dir / "agent.jsonl").open("rb") as fh:
            head = fh.read(256 * 1024)
    except OSError:
        return ""
    for line in head.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        sid = ev.get("session_id") if isinstance(ev, dict) else None
        if isinstance(sid, str) and SESSION_ID.fullmatch(sid):
            return sid
    return ""


def _prev_base(settings: Settings, prev: TaskRow) -> str:
    try:
        doc = json.loads(TaskPaths(settings.data_dir, prev.id).report_file.read_text())
    except (OSError, ValueError):
        return ""
    base = doc.get("base_commit") if isinstance(doc, dict) else None
    return base if isinstance(base, str) else ""


def _pending(settings: Settings, task_id: str) -> Path:
    return settings.data_dir / "continue" / f"{task_id}.json"


def forget(settings: Settings, task_id: str) -> bool:
    """Drop a removed task's pending plan (True if there was one; never follows a link)."""
    with contextlib.suppress(FileNotFoundError):
        _pending(settings, task_id).unlink()
        return True
    return False


def pending_ids(settings: Settings) -> list[tuple[str, float]]:
    """The task ids that have a pending plan, with the plan's mtime."""
    out = []
    with contextlib.suppress(OSError), os.scandir(settings.data_dir / "continue") as it:
        for entry in it:
            stem, dot, ext = entry.name.rpartition(".")
            if dot and ext == "json" and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    out.append((stem, entry.stat(follow_symlinks=False).st_mtime))
    return sorted(out)


def record(settings: Settings, task_id: str, cont: Continuation | None) -> None:
    """Keep the plan until the task's workspace is made (called at submit; None: nothing)."""
    if cont is None:
        return
    where = _pending(settings, task_id)
    where.parent.mkdir(mode=0o700, exist_ok=True)
    _write(where, cont)


def _write(where: Path, cont: Continuation) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(where, flags, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(cont), fh)


def _load(path: Path) -> Continuation | None:
    try:
        doc = json.loads(path.read_text())
        fields = {k: str(doc[k]) for k in ("previous", "base_commit", "previous_status")}
        sid = doc.get("session", "")
        return Continuation(**fields, session=sid if SESSION_ID.fullmatch(str(sid)) else "")
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
    try:
        text = _previous_text(settings, cont)
        target = paths.workspace / PREVIOUS_FILE
        target.parent.mkdir(mode=0o755, exist_ok=True)
        target.write_text(text)
    except (OSError, AgentboxError) as exc:  # the task still runs, on the right base
        log.warning("previous task not written for the agent", task_id=paths.task_id,
                    error=str(exc))  # fmt: skip
    carried = _carry_session(settings, cont, paths) if cont.session else False
    _write(paths.root / _RECORD, replace(cont, session=cont.session if carried else ""))
    # The pending record stays: a task requeued by a later launcher (its partial task dir
    # discarded) is prepared again from it.


def _carry_session(settings: Settings, cont: Continuation, paths: TaskPaths) -> bool:
    """Copy the previous Claude Code session file into the new workspace; False if absent.

    Read beneath the previous workspace with no link followed (the agent wrote that
    tree: a link there must not make us copy a host file into the sandbox), capped.
    """
    from agentbox.safepath import Tree

    rel = f"{CLAUDE_CONFIG_IN_WORKSPACE}/projects/{PROJECT_DIR}/{cont.session}.jsonl"
    try:
        with Tree(TaskPaths(settings.data_dir, cont.previous).workspace) as tree:
            data = tree.read(rel, limit=MAX_SESSION_BYTES)
        target = paths.workspace / rel
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        target.write_bytes(data)
    except (OSError, AgentboxError) as exc:
        log.warning("no session to resume", task_id=paths.task_id, previous=cont.previous,
                    error=str(exc))  # fmt: skip
        return False
    return True


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


def continues(settings: Settings, paths: TaskPaths) -> bool:
    """Whether the task continues a previous one (its workspace is that task's result)."""
    return any(
        _load(p) is not None for p in (paths.root / _RECORD, _pending(settings, paths.task_id))
    )


def resume_session(paths: TaskPaths) -> str | None:
    """The Claude Code session a continued task resumes (None: none, or not a continuation)."""
    cont = _load(paths.root / _RECORD)
    return cont.session if cont is not None and cont.session else None


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
