"""The MCP tools: delegate, status, result, transcript, cancel, list_tasks, models.

Every argument arrives from a model that may be prompt-injected. Arguments are
validated by their schema first (types, ranges, lengths), then by us (the repo
must be a git repo of ours inside the repos root, the id must match
``^[0-9a-z-]{1,64}$``), and only then does anything reach the launcher, over
its unix socket, as a :class:`~agentbox.launcher.api.TaskRequest`. Failures
come back as MCP tool errors (``is_error``) whose text says what was wrong and
what to do, never as a crash.

Text the sandboxed agent wrote (the report's final message and file names, the
diff, errors quoting them) goes back to the host agent only inside a framed
block (:func:`agentbox.mcp._untrusted.frame`) that says it is data, not
instructions; paths that run code when the branch is opened or merged are
listed above it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from agentbox._log import get_logger
from agentbox.errors import AgentboxError, PathRefused, RefusedError
from agentbox.launcher.api import (
    MAX_BUDGET,
    MAX_DEADLINE,
    MAX_TASK_CHARS,
    MIN_DEADLINE,
    NO_CHANGES,
    TERMINAL,
    TaskInfo,
    TaskRequest,
    TaskResult,
)
from agentbox.launcher.client import LauncherClient
from agentbox.mcp._fetch import branch_name, fetch_branch
from agentbox.mcp._repo import validate_repo
from agentbox.mcp._untrusted import frame
from agentbox.paths import validate_task_id
from agentbox.transcript import TranscriptPage, event_text

__all__ = ["DEFAULT_MAX_DIFF_CHARS", "DEFAULT_MAX_PENDING", "ServerConfig", "build_server"]

log = get_logger("mcp")

DEFAULT_MAX_PENDING = 4
DEFAULT_MAX_DIFF_CHARS = 40_000
MAX_REPORT_CHARS = 16_000
#: Events of the transcript's tail in a `result`.
RESULT_TAIL_EVENTS = 30
#: The most characters of transcript text in one tool answer.
MAX_TRANSCRIPT_CHARS = 40_000
POLL_SECONDS = 1.0

INSTRUCTIONS = """\
agentbox runs a coding task on a copy of one of your git repos, with Claude Code inside a
hardened sandbox that has no network and its own metered model gateway. The result comes back
as a git branch agentbox/<task-id> in your repo, plus a diff and a report. Delegate work that
can be checked by reading a diff (a fix, a test, a refactor). Use `delegate` with wait=true
for a short task; for a long one, delegate without waiting and poll `status`, then `result`.
`transcript` shows what the agent ran and what came back (each command with its output).
"""

_T = TypeVar("_T")


@dataclass(frozen=True)
class ServerConfig:
    """What the MCP server needs: where repos may live and how to reach the launcher."""

    repos_root: Path
    data_dir: Path
    socket_path: Path
    """The launcher's socket (may be a ``/proc/self/fd/N`` path opened before a privilege drop)."""
    max_pending: int = DEFAULT_MAX_PENDING
    """How many of our tasks may be queued or running at once; more delegate calls are refused."""
    max_diff_chars: int = DEFAULT_MAX_DIFF_CHARS


def _tool_error(exc: AgentboxError) -> ToolError:
    return ToolError(f"{type(exc).__name__}: {exc}")


class _Tools:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.client = LauncherClient(config.socket_path, timeout=60.0)
        self._submit_lock = anyio.Lock()

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return await anyio.to_thread.run_sync(fn, *args)
        except AgentboxError as exc:
            raise _tool_error(exc) from exc

    @staticmethod
    def _task_id(task_id: str) -> str:
        try:
            return validate_task_id(task_id)
        except RefusedError as exc:
            raise _tool_error(exc) from exc

    # -- tools -------------------------------------------------------------

    async def delegate(
        self,
        repo: Annotated[
            str,
            Field(
                min_length=1,
                max_length=4096,
                description="Absolute path of the git repo to work on (inside the repos root).",
            ),
        ],
        task: Annotated[
            str,
            Field(
                min_length=1,
                max_length=MAX_TASK_CHARS,
                description="The task for the sandboxed agent, written as a complete, "
                "self-contained spec: what to change, where, and how to check it.",
            ),
        ],
        ctx: Context,
        model: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=128,
                description="A model name from `models`; omit for the default.",
            ),
        ] = None,
        budget: Annotated[
            int | None,
            Field(ge=1, le=MAX_BUDGET, description="Token budget; omit for the default (20M)."),
        ] = None,
        deadline: Annotated[
            float | None,
            Field(
                ge=MIN_DEADLINE,
                le=MAX_DEADLINE,
                description="Seconds before the sandbox is killed; omit for the default (1 h).",
            ),
        ] = None,
        wait: Annotated[
            bool,
            Field(
                description="true: block until the task ends and return its report and diff "
                "(progress is reported meanwhile); false: return the task id at once."
            ),
        ] = False,
        include_uncommitted: Annotated[
            bool,
            Field(
                description="Also copy the repo's uncommitted changes into the agent's copy "
                "(otherwise a repo with uncommitted changes is refused)."
            ),
        ] = False,
    ) -> str:
        """Delegate a coding task to a sandboxed Claude Code working on a copy of `repo`.

        The agent edits a fresh copy (the repo's committed HEAD, plus uncommitted changes with
        include_uncommitted=true); your working tree is never touched. When it stops, its
        changes become the commit on branch `agentbox/<task-id>` in `repo` (if it changed
        nothing, the result says "no changes" and no branch is made). Returns the task
        id, or with wait=true the report, the diff and the branch.
        Refused: a repo outside the repos root, a symlinked path, a repo that is not yours or
        not a git repo, too many tasks already in flight.
        """
        try:
            path = validate_repo(self.config.repos_root, repo)
        except PathRefused as exc:
            raise _tool_error(exc) from exc
        request = TaskRequest(
            repo=str(path),
            task=task,
            model=model,
            budget=budget,
            deadline=deadline,
            include_uncommitted=include_uncommitted,
            publish=False,
        )
        async with self._submit_lock:
            tasks = await self._call(self.client.list)
            pending = [t for t in tasks if t.status not in TERMINAL]
            if len(pending) >= self.config.max_pending:
                raise ToolError(
                    f"queue full: {len(pending)} tasks are already queued or running "
                    f"(limit {self.config.max_pending}); wait for one to finish (`status`, "
                    "`list_tasks`) or `cancel` one, then delegate again"
                )
            info = await self._call(self.client.submit, request)
        log.info("delegated", task_id=info.id, repo=str(path))
        if not wait:
            return (
                f"Task {info.id} is {info.status} (model {info.model}, budget {info.budget} "
                f"tokens, deadline {info.deadline:g} s). Call `status` with id {info.id!r} to "
                f"follow it and `result` when it is done; the branch will be "
                f"{branch_name(info.id)}."
            )
        info = await self._wait(info, ctx)
        return await self._result_text(info)

    async def status(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id from `delegate`.")],
    ) -> str:
        """The state of one task: queued, running, collecting, done, failed, timed_out or
        cancelled, with elapsed time, tokens used and the exit code."""
        info = await self._call(self.client.get, self._task_id(id))
        return _info_json(info)

    async def result(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id from `delegate`.")],
    ) -> str:
        """The result of a finished task: its report (status, exit code, tokens, what was
        skipped), the diff (truncated with a note when large) and the branch
        `agentbox/<id>` it was fetched to in the repo. Fails while the task is still running."""
        info = await self._call(self.client.get, self._task_id(id))
        if info.status not in TERMINAL:
            raise ToolError(
                f"task {info.id} is still {info.status}; call `status` until it is done, "
                "or `delegate` with wait=true next time"
            )
        return await self._result_text(info)

    async def transcript(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id from `delegate`.")],
        since: Annotated[
            int | None,
            Field(
                ge=-500,
                le=1_000_000,
                description="The first event to show (from the previous answer's `next`); "
                "omit for the start; negative: the last -since events.",
            ),
        ] = None,
    ) -> str:
        """What the agent did, as numbered events: launcher phases, each tool call (the
        command) with its result (exit code and output), the agent's messages, gateway
        refusals. Works while the task runs; page on with `since`."""
        page = await self._call(
            lambda: self.client.transcript(self._task_id(id), since=since or 0, limit=200)
        )
        return _transcript_text(page, tail_lines=40)

    async def cancel(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id to stop.")],
    ) -> str:
        """Stop a queued or running task. What it wrote so far is still collected and can be
        read with `result`."""
        info = await self._call(self.client.cancel, self._task_id(id))
        return _info_json(info)

    async def list_tasks(self) -> str:
        """Your tasks (newest first; root sees every task) with its state, repo and tokens."""
        tasks = await self._call(self.client.list)
        return frame(json.dumps([_info_dict(t) for t in tasks[:200]], indent=1), _STATE)

    async def models(self) -> str:
        """The models a delegated task may use (pass one as `model`): `default` marks the one
        used when you pass none (`default_reason` says why); one with `available` false
        cannot be used here (`unavailable_reason`: e.g. its API key is not set)."""
        models = await self._call(self.client.models)
        return json.dumps([m.model_dump(mode="json") for m in models], indent=1)

    # -- helpers -------------------------------------------------------------

    async def _wait(self, info: TaskInfo, ctx: Context) -> TaskInfo:
        start = time.monotonic()
        while info.status not in TERMINAL:
            elapsed = time.monotonic() - start
            tokens = info.tokens.total
            await ctx.report_progress(
                elapsed, info.deadline, f"{info.status}: {elapsed:.0f}s, {tokens} tokens"
            )
            await anyio.sleep(POLL_SECONDS)
            info = await self._call(self.client.get, info.id)
        return info

    async def _result_text(self, info: TaskInfo) -> str:
        res = await self._call(self.client.result, info.id)
        fetched = await self._fetch(info, res)
        text = _format_result(info, res, fetched, self.config.max_diff_chars)
        try:
            tail = await self._call(
                lambda: self.client.transcript(info.id, since=-RESULT_TAIL_EVENTS, limit=200)
            )
        except ToolError as exc:  # an older launcher, say: the result stands without it
            return f"{text}\n(no transcript: {exc})\n"
        return f"{text}\n{_transcript_text(tail, tail_lines=15)}"

    async def _fetch(self, info: TaskInfo, res: TaskResult) -> str:
        if res.changed is False:
            # "no changes" only for a task that finished; a failed one says why (its error).
            return NO_CHANGES if res.status == "done" else "no branch: nothing was changed"
        if not res.commit or not res.shadow_git:
            return "no branch: nothing was collected"
        try:
            repo = validate_repo(self.config.repos_root, info.repo)
            shadow = Path(res.shadow_git)
            data = self.config.data_dir
            if not shadow.is_absolute() or ".." in shadow.parts or data not in shadow.parents:
                raise PathRefused("launcher's shadow dir is not inside the data dir", path=shadow)
            if not os.access(shadow / "HEAD", os.R_OK):
                raise PathRefused(
                    f"the launcher's shadow dir is not readable by uid {os.geteuid()} (the "
                    "launcher must give the group agentbox read access to it)",
                    path=shadow,
                )
            branch = await anyio.to_thread.run_sync(fetch_branch, repo, shadow, info.id, res.commit)
        except AgentboxError as exc:
            log.warning("fetch failed", task_id=info.id, error=str(exc))
            return f"branch {branch_name(info.id)} NOT fetched: {exc}"
        return f"branch {branch} in {repo} (commit {res.commit})"


def _info_dict(info: TaskInfo) -> dict[str, Any]:
    d = info.model_dump(mode="json")
    d["task"] = d["task"][:200]
    d["tokens_total"] = info.tokens.total
    if info.changed is False and info.status == "done":
        d["outcome"] = NO_CHANGES
    end = info.finished_at or time.time()
    d["elapsed_s"] = round(end - info.started_at, 1) if info.started_at else 0.0
    return d


_STATE = "task state as JSON; its error and phase fields may quote what the agent wrote"


def _info_json(info: TaskInfo) -> str:
    return frame(json.dumps(_info_dict(info), indent=1), _STATE)


def _flagged_text(report: dict[str, Any]) -> str:
    """The warning about paths that run code, for above the framed diff ("" if none)."""
    flagged = report.get("flagged")
    if not isinstance(flagged, list) or not flagged:
        return ""
    lines = [
        f"WARNING: this result changes {len(flagged)} path(s) that make other tools run code "
        "when the branch is opened, checked out or merged. Tell the user and review them "
        "before checking the branch out or merging it (names as JSON strings, chosen by the "
        "sandboxed agent):"
    ]
    for f in flagged[:100]:
        if isinstance(f, dict):
            path = json.dumps(str(f.get("path", "?")))
            lines.append(f"  {f.get('change', '?')} {path}: {f.get('reason', '')}")
    return "\n".join(lines) + "\n"


def _format_result(info: TaskInfo, res: TaskResult, fetched: str, max_diff: int) -> str:
    report = json.dumps(res.report, indent=1, default=str)
    if len(report) > MAX_REPORT_CHARS:
        report = report[:MAX_REPORT_CHARS] + f"\n[report truncated at {MAX_REPORT_CHARS} chars]"
    diff = res.diff
    note = ""
    if len(diff) > max_diff:
        note = (
            f"\n[diff truncated: showing {max_diff} of {len(diff)} characters; the full change "
            f"is on branch {branch_name(info.id)}: git diff {branch_name(info.id)}~1 "
            f"{branch_name(info.id)}]"
        )
        diff = diff[:max_diff]
    elif res.diff_truncated:
        note = f"\n[diff truncated by the launcher; see branch {branch_name(info.id)}]"
    head = (
        f"task {info.id}: {res.status} (exit code {info.exit_code}), "
        f"{info.tokens.total} tokens; {_tests_word(res.report)}\n{fetched}\n"
    )
    error = f"error: {info.error}\n\n" if info.error else ""
    body = f"{error}report:\n{report}\n\ndiff:\n{diff or '(no changes)'}\n"
    what = "the task's report (with the agent's final message) and the diff of its files"
    return f"{head}{_flagged_text(res.report)}\n{frame(body, what)}{note.lstrip()}\n"


def _tests_word(report: dict[str, Any]) -> str:
    """Whether the agent ran tests and how they exited (no agent text: the command is
    in the framed report)."""
    ltc = report.get("last_test_command")
    if not isinstance(ltc, dict):
        return "tests: none run (the agent ran no test command)"
    code = ltc.get("exit_code")
    if not isinstance(code, int):
        return "tests: ran, exit code unknown (see last_test_command in the report)"
    word = "passed" if code == 0 else "FAILED"
    return f"tests: {word} (exit {code}; the command is last_test_command in the report)"


def _transcript_text(page: TranscriptPage, *, tail_lines: int) -> str:
    """A page of the transcript: counts outside, every event inside a framed block."""
    start = page.next - len(page.events)
    parts: list[str] = []
    size = 0
    for e in page.events:
        line = event_text(e, tail_lines=tail_lines)
        if size + len(line) > MAX_TRANSCRIPT_CHARS:
            break
        parts.append(line)
        size += len(line) + 1
    nxt = start + len(parts)
    more = (
        f"call transcript with since={nxt} for the next ones"
        if nxt < page.total
        else "no more events yet"
    )
    head = (
        f"transcript of task {page.task_id}: events {start}..{max(start, nxt - 1)} of "
        f"{page.total} ({more}); tools run: {sum(page.tools_run.values())}; "
        f"tokens metered by the gateway: {page.tokens.total}\n"
    )
    what = "the task's transcript: the agent's commands, their output and its messages"
    return head + frame("\n".join(parts) or "(no events)", what)


def build_server(config: ServerConfig) -> MCPServer:
    """The MCP server with agentbox's seven tools, talking to the launcher at ``config``."""
    tools = _Tools(config)
    server: MCPServer = MCPServer(
        "agentbox", instructions=INSTRUCTIONS, log_level="WARNING", warn_on_duplicate_tools=False
    )
    ro = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    server.add_tool(
        tools.delegate,
        name="delegate",
        annotations=ToolAnnotations(destructive_hint=False, open_world_hint=False),
    )
    server.add_tool(tools.status, name="status", annotations=ro)
    server.add_tool(
        tools.result,
        name="result",
        annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True),
    )
    server.add_tool(tools.transcript, name="transcript", annotations=ro)
    server.add_tool(tools.cancel, name="cancel", annotations=ToolAnnotations(destructive_hint=True))
    server.add_tool(tools.list_tasks, name="list_tasks", annotations=ro)
    server.add_tool(tools.models, name="models", annotations=ro)
    return server
