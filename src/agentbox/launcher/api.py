"""The launcher's wire schema: what a client may ask, and what it gets back.

Clients (the CLI, the MCP server, ``agentbox serve``) choose *which* task and
*which* model, never *how*: a request names a repo, a task text, a model from
the registry, a budget, a deadline and optionally an id. Everything else (paths,
the command, the environment, the mounts) is derived by the launcher.

The same models are used by the Python API (:class:`agentbox.launcher.Launcher`)
and by the unix-socket HTTP API (``agentbox launcher serve``), whose routes are::

    POST /v1/tasks                 TaskRequest  -> TaskInfo      (201)
    GET  /v1/tasks                              -> TaskList
    GET  /v1/tasks/{id}                         -> TaskInfo
    POST /v1/tasks/{id}/cancel                  -> TaskInfo
    POST /v1/tasks/{id}/publish                 -> TaskInfo
    POST /v1/tasks/{id}/push      PushRequest  -> PushInfo      (agentbox.launcher.pushapi)
    POST /v1/groups               GroupRequest -> TaskList      (201: the attempts, best-of-N)
    GET  /v1/groups/{id}[?by=R]                -> GroupView     (agentbox.launcher.attempts)
    POST /v1/groups/{id}/publish[?pick=K]      -> TaskInfo      (the pick as agentbox/<id>)
    GET  /v1/tasks/{id}/result                  -> TaskResult    (409 while not finished)
    GET  /v1/models                             -> ModelList
    /v1/sandboxes/...                           (the SDK's sandboxes: agentbox.launcher.boxapi)

Errors are ``{"error": "<ExceptionClass>", "message": "..."}`` with status 400
(refused: bad id, repo, model, range), 403 (a connection that was not
peer-checked), 404 (unknown task, or another user's), 409 (not finished),
422 (malformed body), 500 (anything else). The client maps them back onto
:mod:`agentbox.errors`.

Who may connect, and what each caller sees: only root, the launcher's uid and
members of the group ``agentbox`` get an answer (the server reads the peer's
credentials from the kernel before any HTTP); a non-root caller lists, reads and
cancels only the tasks it submitted, and may delegate only repos it owns. The
uid is never sent by the client: it is what the kernel says.

Every model is strict and forbids unknown fields: a request with ``"budget":
"5"`` or an extra key is refused, not coerced.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.core.wire import NO_CHANGES, TokenUsage

__all__ = [
    "DEFAULT_BUDGET",
    "MAX_BUDGET",
    "MAX_DEADLINE",
    "MAX_TASK_CHARS",
    "MIN_DEADLINE",
    "NO_CHANGES",
    "TERMINAL",
    "GroupRequest",
    "ModelInfo",
    "ModelList",
    "TaskInfo",
    "TaskList",
    "TaskRequest",
    "TaskResult",
    "TaskStatus",
    "TokenUsage",
]

#: Default token budget of a task (the seed's 20M).
DEFAULT_BUDGET = 20_000_000
#: The largest budget a request may ask for.
MAX_BUDGET = 10_000_000_000
#: Deadline bounds, seconds.
MIN_DEADLINE = 10.0
MAX_DEADLINE = 24 * 3600.0
#: Default deadline, seconds.
DEFAULT_DEADLINE = 3600.0
#: Longest task text accepted.
MAX_TASK_CHARS = 32768
#: A task id: lowercase letters, digits and '-', 1 to 64 characters.
TASK_ID_PATTERN = r"^[0-9a-z-]{1,64}$"

TaskStatus = Literal["queued", "running", "collecting", "done", "failed", "timed_out", "cancelled"]
#: Statuses a task never leaves.
TERMINAL: frozenset[str] = frozenset({"done", "failed", "timed_out", "cancelled"})


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TaskRequest(_Wire):
    """A request to run one task. Re-validated by the launcher (repo, model, ranges)."""

    repo: str = Field(min_length=1, max_length=4096)
    """Absolute path of a git repo that resolves inside the configured repos root."""
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS)
    """What the agent is asked to do (the task spec given to ``claude -p``)."""
    model: str | None = Field(default=None, min_length=1, max_length=128)
    """A model name from the registry; None: the registry's default."""
    budget: int | None = Field(default=None, ge=1, le=MAX_BUDGET)
    """Token budget (input + output + cache); None: the default (20M)."""
    budget_usd: float | None = Field(default=None, gt=0, le=1_000_000)
    """A dollar budget at the model's registry prices; None: the Boxfile's, else none.
    Refused for a model without prices."""
    deadline: float | None = Field(default=None, ge=MIN_DEADLINE, le=MAX_DEADLINE)
    """Seconds of wall time before the sandbox is killed; None: the default (1 h)."""
    task_id: str | None = Field(default=None, pattern=TASK_ID_PATTERN)
    """The task's id; None: generated."""
    include_uncommitted: bool = False
    """Copy uncommitted changes too (otherwise a dirty repo is refused)."""
    publish: bool = True
    """Fetch the result branch ``agentbox/<id>`` into the user's repo."""
    continue_from: str | None = Field(default=None, pattern=TASK_ID_PATTERN)
    """A finished task of the same repo to continue: the workspace starts from its result
    commit (which must be in the repo: published, or fetched by the MCP server), and the
    agent is given its task, transcript and last message."""


class GroupRequest(_Wire):
    """A best-of-N group: ``attempts`` attempts of ``request`` (``POST /v1/groups``); the
    request's ``task_id`` names the group (its attempts are ``<group>-aK``)."""

    request: TaskRequest
    attempts: int = Field(ge=1, le=8)
    budget_split: Literal["split", "shared"] = "split"
    """``split``: each attempt gets the budget divided by ``attempts``; ``shared``: the
    attempts draw from the one budget, never passed in total."""


class TaskInfo(_Wire):
    """The state of one task."""

    id: str
    status: TaskStatus
    repo: str
    task: str
    model: str
    budget: int
    deadline: float
    created_at: float
    """Unix time the request was accepted."""
    started_at: float | None = None
    """Unix time the sandbox started."""
    finished_at: float | None = None
    exit_code: int | None = None
    """The agent's exit code (None: it never ran or was killed)."""
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    branch: str | None = None
    """``agentbox/<id>`` once published."""
    changed: bool | None = None
    """Whether the agent changed any file: None until collected (or when collection
    failed); False means **no changes**: an empty diff, and no branch was made."""
    error: str | None = None
    """Why the task failed, was cancelled or timed out."""
    phase: str = ""
    """What the launcher is doing now, in words ("copying the workspace", "agent running" …)."""
    uid: int | None = None
    """The uid that submitted the task (None: from before uids were recorded). A caller
    other than root sees only its own tasks."""
    backend: str | None = None
    """The sandbox backend it runs on (podman, docker, qemu, firecracker)."""
    runtime: str | None = None
    """The OCI runtime of a podman or docker sandbox (runc, crun, runsc); None on a
    microVM backend, which runs none."""
    group: str | None = None
    """Best-of-N: the group this task is an attempt of (``agentbox run --attempts N``)."""
    attempt: int | None = None
    """Its index (1-based) in the group; its id is ``<group>-a<attempt>``."""
    resources: dict[str, Any] | None = None
    """What its sandbox used (CPU seconds, peak memory, disk written, processes, egress
    bytes): live while it runs (``live`` true), final once it ended; None: not sampled.
    See :mod:`agentbox.observe.resources` and ``docs/reference/report.md``."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class TaskList(_Wire):
    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    tasks: list[TaskInfo]


class TaskResult(_Wire):
    """What a finished task left: the report, the diff, where the commit lives."""

    task_id: str
    status: TaskStatus
    report: dict[str, Any]
    """The collection report (JSON): status, exit code, diffstat, tokens, skipped, message."""
    diff: str
    """The branch's diff against its base (may be truncated)."""
    diff_truncated: bool
    branch: str
    """``agentbox/<id>`` in the user's repo ("" when not published)."""
    shadow_git: str
    """The trusted git dir holding the commit (fetchable even when not published)."""
    commit: str
    """The result commit's id ("" when nothing was collected, or there were no changes)."""
    changed: bool | None = None
    """As :attr:`TaskInfo.changed`: False means the agent changed nothing (no commit,
    no branch, an empty diff); None means nothing was collected."""
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    """What the task used (as :attr:`TaskInfo.tokens`)."""
    cost_usd: float | None = None
    """Dollars at the model's registry prices; None: the price is unknown (never $0)."""


class ModelInfo(_Wire):
    """A model a task may use."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    name: str
    kind: str
    """``replay``, ``anthropic``, ``local`` ..."""
    default: bool = False
    description: str = ""
    available: bool = True
    """False when a task could not use it here (its API key is not set)."""
    unavailable_reason: str = ""
    default_reason: str = ""
    """On the default entry: why it is the default (set in the file, built in, first)."""


class ModelList(_Wire):
    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)
    models: list[ModelInfo]
