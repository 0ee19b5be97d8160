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

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from agentbox.core.log import get_logger
from agentbox.core.paths import validate_task_id
from agentbox.errors import AgentboxError, PathRefused, RefusedError, UncommittedChanges
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
from agentbox.launcher.pushapi import PushRequest
from agentbox.mcp._fetch import branch_name, fetch_branch
from agentbox.mcp._format import (
    STATE,
    format_result,
    info_dict,
    info_json,
    transcript_text,
)
from agentbox.mcp._format import info_dict as _info_dict  # noqa: F401 (tests import it here)
from agentbox.mcp._repo import validate_repo
from agentbox.mcp._untrusted import frame

log = get_logger(__name__)

DEFAULT_MAX_PENDING = 4
DEFAULT_MAX_DIFF_CHARS = 40_000
#: Events of the transcript's tail in a `result`.
RESULT_TAIL_EVENTS = 30
POLL_SECONDS = 1.0

INSTRUCTIONS = """\
agentbox runs a coding task on a copy of one of your git repos, with Claude Code inside a
hardened sandbox that has no network and its own metered model gateway. The result comes back
as a git branch agentbox/<task-id> in your repo, plus a diff and a report. Delegate work that
can be checked by reading a diff (a fix, a test, a refactor). Use `delegate` with wait=true
for a short task; for a long one, delegate without waiting and poll `status`, then `result`.
`transcript` shows what the agent ran and what came back (each command with its output).
To follow up on a finished task (fix what it missed, go on), `delegate` with
continue_from=<its id>: the new task starts from its branch and resumes its session.
When the user wants the result reviewed on GitHub or GitLab, `publish` with pr=true pushes
the branch to the repo's remote (as the user) and opens a pull request with the report.
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
    # An option is named as the tool spells it (the launcher's words name none).
    text = (
        exc.with_option("include_uncommitted=true") if isinstance(exc, UncommittedChanges) else exc
    )
    return ToolError(f"{type(exc).__name__}: {text}")


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
        budget_usd: Annotated[
            float | None,
            Field(
                gt=0,
                le=1_000_000,
                description="Dollar budget at the model's prices; omit for none. Refused for a "
                "model without prices (see `models`).",
            ),
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
        continue_from: Annotated[
            str | None,
            Field(
                max_length=64,
                description="The id of a finished task of this repo to continue: the new task "
                "starts from that task's branch (fetched into the repo first), its agent resumes "
                "the previous agent's session and is given the previous request, transcript "
                "and last message. The new branch stacks on the previous one.",
            ),
        ] = None,
        attempts: Annotated[
            int,
            Field(
                ge=1,
                le=8,
                description="Best-of-N: run this many attempts of the task at once (each its "
                "own sandbox; the budget split between them), scored by their tests and diff "
                "size; with wait=true the result is the group's scores and the picked attempt's "
                "report and diff.",
            ),
        ] = 1,
        budget_split: Annotated[
            Literal["split", "shared"],
            Field(
                description="With attempts > 1: 'split' gives each attempt the budget divided "
                "by attempts; 'shared' lets them draw from the one budget (never passed in "
                "total: a greedy attempt leaves less for the others).",
            ),
        ] = "split",
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
        if continue_from is not None:
            await self._previous_branch(self._task_id(continue_from))
        request = TaskRequest(
            repo=str(path),
            task=task,
            model=model,
            budget=budget,
            budget_usd=budget_usd,
            deadline=deadline,
            include_uncommitted=include_uncommitted,
            publish=False,
            continue_from=continue_from,
        )
        if attempts > 1:
            return await self._delegate_group(request, attempts, wait, ctx, budget_split)
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
        note = await self._scripted_note(info.model)
        if not wait:
            return note + (
                f"Task {info.id} is {info.status} (model {info.model}, budget {info.budget} "
                f"tokens, deadline {info.deadline:g} s). Call `status` with id {info.id!r} to "
                f"follow it and `result` when it is done; the branch will be "
                f"{branch_name(info.id)}."
            )
        info = await self._wait(info, ctx)
        return note + await self._result_text(info)

    async def _delegate_group(
        self, request: TaskRequest, attempts: int, wait: bool, ctx: Context,
        budget_split: str = "split",
    ) -> str:  # fmt: skip
        """``delegate(attempts=N)``: one best-of-N group; with ``wait`` the scores (numbers,
        ids and statuses only: the agents' test command lines are left out) and the pick's
        result text."""
        async with self._submit_lock:
            tasks = await self._call(self.client.list)
            pending = [t for t in tasks if t.status not in TERMINAL]
            if len(pending) + attempts > self.config.max_pending:
                raise ToolError(
                    f"queue full: {len(pending)} tasks are queued or running and {attempts} "
                    f"attempts would pass the limit ({self.config.max_pending}); wait or cancel"
                )
            infos = await self._call(
                functools.partial(self.client.submit_group, budget_split=budget_split),
                request, attempts,
            )  # fmt: skip
        group = infos[0].group
        ids = [i.id for i in infos]
        log.info("delegated a group", group=group, attempts=len(ids))
        note = await self._scripted_note(infos[0].model)
        if not wait:
            return note + (
                f"Group {group}: {len(ids)} attempts {', '.join(ids)} are queued (budget "
                f"{infos[0].budget} tokens {'shared' if budget_split == 'shared' else 'each'}). "
                "Follow each with `status` and read each "
                "with `result`; the pick is the first whose tests passed, then the smallest diff."
            )
        for info in infos:
            await self._wait(info, ctx)
        view = await self._call(self.client.group, group)
        scores = [a.model_copy(update={"test_command": None}) for a in view.attempts]
        shown = view.model_copy(update={"attempts": scores}).model_dump_json(indent=1)
        text = f"Group {group} ended; scores and pick (JSON):\n{shown}\n"
        if view.pick_id is None:
            return note + text + "No attempt qualifies (none ended done with passing tests)."
        picked = await self._call(self.client.get, view.pick_id)
        return note + text + f"The pick, attempt {view.pick}:\n" + await self._result_text(picked)

    async def _scripted_note(self, model: str) -> str:
        """One line when the task's model is scripted (the replay model), else ""."""
        try:
            models = await self._call(self.client.models)
        except ToolError:
            return ""
        if any(m.name == model and m.kind == "replay" for m in models):
            return (
                f"Note: model {model!r} is scripted (the replay model plays a fixed script; no "
                "real model runs); for a real one the launcher needs ANTHROPIC_API_KEY and "
                "model='sonnet' (see `models`).\n"
            )
        return ""

    async def status(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id from `delegate`.")],
    ) -> str:
        """The state of one task: queued, running, collecting, done, failed, timed_out or
        cancelled, with elapsed time, tokens used and the exit code."""
        info = await self._call(self.client.get, self._task_id(id))
        return info_json(info)

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
        return transcript_text(page, tail_lines=40)

    async def cancel(
        self,
        id: Annotated[str, Field(max_length=64, description="The task id to stop.")],
    ) -> str:
        """Stop a queued or running task. What it wrote so far is still collected and can be
        read with `result`."""
        info = await self._call(self.client.cancel, self._task_id(id))
        return info_json(info)

    async def publish(
        self,
        task_id: Annotated[str, Field(max_length=64, description="A finished task's id.")],
        pr: Annotated[
            bool,
            Field(
                description="true: also open a pull request (GitHub) or merge request (GitLab) "
                "whose body is the task's report; the token is your `agentbox secret` "
                "GITHUB_TOKEN / GITLAB_TOKEN."
            ),
        ] = False,
        draft: Annotated[bool, Field(description="Open the pull request as a draft.")] = False,
        remote: Annotated[
            str,
            Field(
                pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$",
                description="The repo's remote to push to.",
            ),
        ] = "origin",
        base: Annotated[
            str | None,
            Field(
                max_length=200,
                description="The pull request's target branch; omit for the repo's default.",
            ),
        ] = None,
    ) -> str:
        """Push a finished task's branch `agentbox/<id>` to the repo's remote (as you, the
        repo's owner: your git credentials, hooks off, never by force: a remote branch that
        is not an ancestor of the result is refused) and, with pr=true, open a pull request
        whose body is the report. Returns where it went and the pull request's URL."""
        info = await self._call(self.client.get, self._task_id(task_id))
        if info.status not in TERMINAL:
            raise ToolError(f"task {info.id} is still {info.status}; publish it once it is done")
        res = await self._call(self.client.result, info.id)
        fetched = await self._fetch(info, res)  # the branch in the repo first, as the user
        if not fetched.startswith("branch agentbox/") or "NOT fetched" in fetched:
            raise ToolError(f"cannot publish task {info.id}: {fetched}")
        try:
            req = PushRequest(remote=remote, pr=pr, draft=draft, base=base)
        except ValueError as exc:
            raise ToolError(f"invalid publish request: {exc}") from exc
        got = await self._call(self.client.push, info.id, req)
        how = "pushed to" if got.pushed else "already on"
        lines = [f"branch {got.branch} (commit {got.commit}) {how} {got.remote} ({got.remote_url})"]
        if got.pull_request:
            state = "already open" if got.existed else "opened"
            lines.append(f"pull request {state}: {got.pull_request}")
        return "\n".join(lines)

    async def list_tasks(self) -> str:
        """Your tasks (newest first; root sees every task) with its state, repo and tokens."""
        tasks = await self._call(self.client.list)
        return frame(json.dumps([info_dict(t) for t in tasks[:200]], indent=1), STATE)

    async def models(self) -> str:
        """The models a delegated task may use (pass one as `model`): `default` marks the one
        used when you pass none (`default_reason` says why); one with `available` false
        cannot be used here (`unavailable_reason`: e.g. its API key is not set)."""
        models = await self._call(self.client.models)
        return json.dumps([m.model_dump(mode="json") for m in models], indent=1)

    # -- helpers -------------------------------------------------------------

    async def _previous_branch(self, task_id: str) -> None:
        """Fetch a finished task's branch into its repo, so a follow-up can start from it
        (the launcher refuses a continuation whose commit is not in the repo)."""
        prev = await self._call(self.client.get, task_id)
        if prev.status not in TERMINAL:
            raise ToolError(f"task {prev.id} is still {prev.status}; continue it once it is done")
        res = await self._call(self.client.result, prev.id)
        if res.changed:
            fetched = await self._fetch(prev, res)
            if not fetched.startswith("branch agentbox/") or "NOT fetched" in fetched:
                raise ToolError(f"cannot continue task {prev.id}: {fetched}")

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
        text = format_result(info, res, fetched, self.config.max_diff_chars)
        try:
            tail = await self._call(
                lambda: self.client.transcript(info.id, since=-RESULT_TAIL_EVENTS, limit=200)
            )
        except ToolError as exc:  # an older launcher, say: the result stands without it
            return f"{text}\n(no transcript: {exc})\n"
        return f"{text}\n{transcript_text(tail, tail_lines=15)}"

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


def build_server(config: ServerConfig) -> MCPServer:
    """The MCP server with agentbox's eight tools, talking to the launcher at ``config``."""
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
    server.add_tool(
        tools.publish,
        name="publish",
        annotations=ToolAnnotations(
            destructive_hint=False, idempotent_hint=True, open_world_hint=True
        ),
    )
    return server
