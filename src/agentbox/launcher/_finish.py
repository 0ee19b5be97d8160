"""The end of a task: collect the workspace, publish the branch, write the report, mark it.

Whatever happened (exit, crash, deadline, budget, cancel), the workspace is
collected into the shadow git dir, published as ``agentbox/<id>`` and a report
written; tokens come from the gateway's usage file only. An agent that changed
nothing gets no commit and no branch: the task finishes with ``changed`` False,
an empty diff and a report that says "no changes".

Collection and publishing may run twice for one task (a launcher that died
while collecting; the next one collects again): collection makes the same
commit from the same tree, and publishing a branch that already points at our
commit is a no-op, so the second run neither fails nor duplicates.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import stat
import time
from concurrent.futures import Future
from pathlib import Path

from pydantic import TypeAdapter

from agentbox.backends import release_uid_slot
from agentbox.collect import Base, Report, Skipped, branch_name, collect, publish
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths, check_inside
from agentbox.env import release_task_env
from agentbox.env import report_fields as env_report_fields
from agentbox.errors import AgentboxError, PathRefused, PublishRefused
from agentbox.gateway import GatewayHandle, read_usage
from agentbox.launcher._context import TaskContext
from agentbox.launcher._names import sandbox_name
from agentbox.launcher._store import Store, TaskRow
from agentbox.launcher._usage_words import (
    budget_error,
    model_error,
    model_fields,
    task_tokens,
    upstream_down,
)
from agentbox.launcher.api import NO_CHANGES
from agentbox.observe.resources import final_resources
from agentbox.observe.traces import export_task, traces_enabled
from agentbox.transcript import summary as transcript_summary

log = get_logger(__name__)

#: The agent's final message kept in the report is capped.
MAX_MESSAGE_CHARS = 8000

_BASE = TypeAdapter(Base)


def _share_shadow(paths: TaskPaths) -> None:
    """Let the share group read this task's shadow git dir, and nothing else of the task.

    Used for ``publish=False`` tasks: the unprivileged MCP server fetches the result
    branch itself, from the trusted shadow dir. The task dir becomes group-traversable
    (not listable); the shadow dir (ours, never the agent's) group-readable. Links are
    never followed.
    """
    gid = share_gid()
    if gid is None:
        return
    if not paths.data_dir.stat().st_mode & 0o011:
        os.chown(paths.data_dir, -1, gid, follow_symlinks=False)
        paths.data_dir.chmod(paths.data_dir.stat().st_mode | 0o010)
    os.chown(paths.root, -1, gid, follow_symlinks=False)
    paths.root.chmod(0o710)
    for top, dirs, files in os.walk(paths.shadow_git, followlinks=False):
        for name in [*dirs, *files]:
            p = Path(top, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                _unshare(p)  # a pack linked from the base cache: its inode is not this task's
            os.chown(p, -1, gid, follow_symlinks=False)
            extra = 0o050 if stat.S_ISDIR(st.st_mode) else 0o040
            p.chmod(stat.S_IMODE(st.st_mode) | extra)
    os.chown(paths.shadow_git, -1, gid, follow_symlinks=False)
    paths.shadow_git.chmod(stat.S_IMODE(paths.shadow_git.stat().st_mode) | 0o050)


def _unshare(path: Path) -> None:
    """Replace hard-linked file ``path`` by a copy of its own (same mode), so that a change
    of its group or mode reaches no other link (the base cache's entry)."""
    tmp = path.with_name(f".{path.name}.unshare")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        out = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
        try:
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    tmp.replace(path)


def repo_at_use(settings: Settings, row: TaskRow) -> Path:
    """The validated (resolved) repo path must still resolve to itself, inside the root."""
    real = check_inside(settings.repos_root, Path(row.repo), what="repo")
    if real != Path(row.repo):
        raise PathRefused(
            "the repo path now resolves elsewhere (a link was swapped in)", path=row.repo
        )
    return real


#: The unprivileged MCP server's group: it may traverse to a task's shadow git dir.
SHARE_GROUP = "agentbox"


def share_gid() -> int | None:
    try:
        return grp.getgrnam(SHARE_GROUP).gr_gid
    except KeyError:
        return None


def _final_message(stdout_log: Path) -> str:
    """The agent's last message from Claude Code's stream-json ``result`` event (report only)."""
    try:
        with stdout_log.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            tail = fh.read()
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("type") == "result":
            msg = ev.get("result")
            return msg[:MAX_MESSAGE_CHARS] if isinstance(msg, str) else ""
    return ""


def read_diff(paths: TaskPaths) -> tuple[str, bool]:
    """The saved diff of a result and whether it was truncated."""
    try:
        data = (paths.root / "result.diff").read_bytes()
    except OSError:
        return "", False
    truncated = (paths.root / "result.diff.truncated").exists()
    return data.decode(errors="replace"), truncated


def save_base(paths: TaskPaths, base: Base) -> None:
    (paths.root / "base.json").write_bytes(_BASE.dump_json(base))


def load_base(paths: TaskPaths) -> Base | None:
    try:
        return _BASE.validate_json((paths.root / "base.json").read_bytes())
    except (OSError, ValueError):
        return None


def collect_and_finish(
    ctx: TaskContext,
    row: TaskRow,
    *,
    status: str,
    error: str | None,
    exit_code: int | None,
    agent_ran: bool = True,
) -> None:
    """Collect whatever the workspace holds, publish it, write the report, mark the task.

    ``agent_ran`` False (it failed before the agent started): an untouched workspace is
    not reported as "no changes" (``changed`` stays None) but by what failed.
    """
    settings, store, paths, tlog = ctx.settings, ctx.store, ctx.paths, ctx.tlog
    store.update(row.id, expect={"running", "collecting"}, status="collecting")
    tokens, usage_extra = task_tokens(paths)
    refusals = usage_extra.get("refusals") or {}
    base = load_base(paths)
    message = _final_message(paths.log_dir / "agent.jsonl")
    report = Report(
        task_id=row.id,
        status=status,
        exit_code=exit_code,
        model=row.model,
        tokens=tokens,
        budget=row.budget,
        base_commit=base.base_commit if base is not None else None,
        final_message=message or None,
        refused=[f"gateway refused {n} request(s): {why}" for why, n in refusals.items()],
        **transcript_summary(paths.log_dir / "agent.jsonl"),  # tools_run, last_test_command
    )
    commit = ""
    branch = ""
    changed: bool | None = None
    diff, truncated = "", False
    if base is None:
        error = error or "nothing to collect: the workspace was never prepared"
    else:
        tlog("collecting the workspace")
        try:
            collected = collect(
                paths.workspace,
                paths.shadow_git,
                paths.base_index,
                base,
                task_id=row.id,
                message=_commit_message(row, status),
            )
            report.add_collected(collected)
            commit, diff, truncated = collected.commit, collected.diff, collected.diff_truncated
            changed = collected.changed
            report.branch = None
            if not changed and not agent_ran:
                changed = None  # nothing ran to change anything: the error says why
            elif not changed:
                # Nothing to review: no commit, so nothing is published into the user's repo.
                # The agent ran (a failure before it started is said by its error, above),
                # so "no changes" is true of a finished or interrupted task; a task the
                # gateway stopped for budget is said by that error, never "no changes".
                tlog("nothing changed: no branch" if _budget_stopped(paths, status) else NO_CHANGES)
            elif not row.publish:
                _share_shadow(paths)
            else:
                repo_at_use(settings, row)
                try:
                    branch = publish(
                        paths.shadow_git,
                        Path(row.repo),
                        task_id=row.id,
                        commit=commit,
                        record=paths.root / "published.json",
                        root=settings.repos_root,
                    )
                    tlog(f"published {branch}")
                except PublishRefused as exc:
                    # The user's ref is left alone and the result is kept: the task
                    # did its work; `agentbox publish ID --branch NAME` publishes it.
                    tlog(f"not published: {exc}")
                    report.notes.append(Skipped(path=branch_name(row.id), reason=str(exc)))
        except AgentboxError as exc:
            tlog(f"collection failed: {exc}")
            log.error("collection failed", task_id=row.id, error=str(exc))
            status = "failed"
            error = f"collection failed: {exc}"
            changed = None
    finished = time.time()
    started = row.started_at or row.created_at
    report.status = status
    report.error = error
    report.branch = branch or None
    report.changed = changed
    report.duration_s = round(finished - started, 3)
    data = report.model_dump(mode="json")
    data["usage"] = usage_extra
    # Dollars at the model's registry prices; null: the price is unknown (never $0).
    data["cost_usd"] = tokens.cost_usd
    data.update(model_fields(settings, row.model))
    data["agent_ran"] = agent_ran
    data["deadline_s"] = row.deadline
    data["repo"] = row.repo
    if base is not None and base.untracked_note:
        data["untracked_not_copied"] = base.untracked_not_copied
        data["untracked_note"] = base.untracked_note
    data.update(row.placement())  # backend, runtime
    data.update(env_report_fields(paths.root, paths.log_dir))
    data["resources"] = final_resources(paths.root, data)  # cpu, memory, disk, egress
    tmp = paths.report_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(paths.report_file)
    (paths.root / "result.diff").write_text(diff)
    if truncated:
        (paths.root / "result.diff.truncated").touch()
    store.finish(
        row.id,
        status,
        finished_at=finished,
        exit_code=exit_code,
        tokens=tokens,
        branch=branch or None,
        commit_id=commit or None,
        changed=None if changed is None else int(changed),
        error=error,
    )
    # Its sandbox is gone: its host uid range may serve another one now.
    release_uid_slot(settings, sandbox_name(row.id))
    tlog(f"finished: {status}" + (f" ({error})" if error else ""))
    if traces_enabled():  # an OTLP collector is configured: the task's trace (best effort)
        with contextlib.suppress(AgentboxError):
            export_task(settings.data_dir, store.get(row.id), report=data)


#: A commit subject's length, as git tools show it (``git log --oneline``, GitHub).
SUBJECT_CHARS = 72


def commit_subject(task_id: str, task: str) -> str:
    """``agentbox <id>: <summary>``: the task's first line, cut at a word, within 72 chars."""
    lines = [ln.strip() for ln in task.strip().splitlines() if ln.strip()]
    first = " ".join(lines[0].split()) if lines else "task"
    head = f"agentbox {task_id}: "
    room = max(SUBJECT_CHARS - len(head), 10)
    if len(first) > room:
        cut = first[: room - 1]
        if " " in cut[room // 2 :]:
            cut = cut[: cut.rindex(" ")]  # never mid-word when a space is near the end
        first = cut.rstrip(" ,.;:-") + "…"
    return head + first


def _commit_message(row: TaskRow, status: str) -> str:
    """A short subject line; the whole task text in the body."""
    subject = commit_subject(row.id, row.task)
    return f"{subject}\n\n{row.task.strip()}\n\nstatus: {status}\nmodel: {row.model}\n"


def settle(
    ctx: TaskContext, outcome: tuple[str, str | None, int | None], *, agent_ran: bool
) -> None:
    """From how the agent ended (status, error, exit code) to a finished task.

    The outcome is recorded first (``outcome``, ``exit_code``): a launcher that dies
    while collecting leaves it for the next one, which collects again with it.
    """
    paths, store = ctx.paths, ctx.store
    status, error, exit_code = outcome
    down = upstream_down(paths)
    if down is not None and status in ("failed", "done", "timed_out"):
        status, error = "failed", down  # the agent's exit says only "API error"
    with contextlib.suppress(AgentboxError):
        usage = read_usage(paths.usage_file)
        why = budget_error(usage) or model_error(ctx.settings, usage)
        if why is not None and status in ("failed", "done"):
            # Claude Code reports a 403 as "Failed to authenticate", a 404 as an API error:
            # say what it was.
            status, error = "failed", why
    if not agent_ran:
        # A failure before the agent started (no image, a sandbox that would not start):
        # its output log is empty. One that ran and then failed to tear down wrote there.
        with contextlib.suppress(OSError):
            agent_ran = (paths.log_dir / "agent.jsonl").stat().st_size > 0
    store.update(
        paths.task_id,
        expect={"queued", "running", "collecting"},
        outcome=json.dumps([status, error, exit_code, agent_ran]),
    )
    collect_and_finish(
        ctx,
        store.get(paths.task_id),
        status=status,
        error=error,
        exit_code=exit_code,
        agent_ran=agent_ran,
    )


#: The error of a task cancelled before a worker took it (nothing of it ran).
NEVER_STARTED = "cancelled before it started"


def stop_gateway(gateway: Future[GatewayHandle]) -> None:
    """Stop a task's gateway on a path that ends the task before its agent: one that
    failed to start (the future's error) or to stop changes nothing here."""
    with contextlib.suppress(BaseException):
        gateway.result().stop(grace=1.0)


def cancelled_early(ctx: TaskContext, gateway: Future[GatewayHandle] | None = None) -> bool:
    """At a worker's step before the agent: a cancel (this launcher's event or the store's
    flag, from any launcher) ends the task here (True). Its gateway, if started, is
    stopped, what exists collected (nothing of the agent ran: no branch) and the report
    written, and only then ``cancelled`` recorded: a waiter sees it settled, never before."""
    if not ctx.cancelled():
        return False
    ctx.tlog("cancelled before the agent started")
    if gateway is not None:
        stop_gateway(gateway)
    settle(ctx, ("cancelled", "cancelled before the agent started", None), agent_ran=False)
    return True


def recorded_outcome(raw: str | None) -> tuple[tuple[str, str | None, int | None], bool] | None:
    """The outcome :func:`settle` recorded (its status, error, exit code; agent_ran), if any."""
    try:
        got = json.loads(raw) if raw else None
    except ValueError:
        return None
    if (
        not isinstance(got, list)
        or len(got) != 4
        or got[0] not in ("done", "failed", "timed_out", "cancelled")
    ):
        return None
    error = got[1] if isinstance(got[1], str) else None
    code = got[2] if isinstance(got[2], int) and not isinstance(got[2], bool) else None
    return (got[0], error, code), bool(got[3])


def _budget_stopped(paths: TaskPaths, status: str) -> bool:
    """Whether a task that did not finish was stopped by the gateway for budget."""
    if status == "done":
        return False
    try:
        return budget_error(read_usage(paths.usage_file)) is not None
    except AgentboxError:  # no usage file (a reconciled task): not a budget stop
        return False


def finish_orphan(settings: Settings, store: Store, row: TaskRow) -> None:
    """Collect and mark a task whose launcher died (its sandbox and gateway already removed)."""
    ctx = TaskContext.of(settings, store, row.id)
    if not ctx.paths.root.is_dir():
        store.finish(row.id, "failed", error="the launcher stopped before the task dir existed")
        return
    ctx.tlog("a restarted launcher reconciles this task: its launcher died")
    release_task_env(ctx.paths.root)
    started = row.started_at or row.created_at
    if row.cancel_requested:
        status, error = "cancelled", "cancelled; its launcher died; partial result collected"
    elif time.time() - started >= row.deadline:
        status, error = "timed_out", "deadline passed while its launcher was down"
    else:
        status, error = "failed", "interrupted: its launcher died; partial result collected"
    collect_and_finish(ctx, row, status=status, error=error, exit_code=None)
