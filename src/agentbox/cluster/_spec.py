"""What a batch is made of: the tasks file, the attempts sent to nodes, what comes back.

Every value that crosses Ray is a plain pydantic model (or bytes): a node sees
the task text, the model's *name*, the budget and deadline, the Boxfile's
TOML-shaped dict, and the repo as a git bundle. Never a key, never a path on
the driver. What a node sends back is untrusted on the driver and is
re-validated here (strict models, bounded sizes) before anything uses it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentbox.errors import ConfigError
from agentbox.launcher.api import MAX_BUDGET, MAX_DEADLINE, MAX_TASK_CHARS, MIN_DEADLINE

#: The largest result bundle a driver accepts from a node (bytes).
MAX_RESULT_BUNDLE = 256 * 1024 * 1024
#: The largest tasks file line (characters).
_MAX_LINE = MAX_TASK_CHARS + 8192


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BatchTask(_Strict):
    """One line of ``tasks.jsonl``: a repo on the driver, a task text, optional overrides."""

    repo: str = Field(min_length=1, max_length=4096)
    """A git repo on the driver (a path; ``~`` is expanded). Its HEAD commit is the base."""
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS)
    model: str | None = Field(default=None, min_length=1, max_length=128)
    budget: int | None = Field(default=None, ge=1, le=MAX_BUDGET)
    """This task's token budget (reserved from the batch budget before it is placed)."""
    deadline: float | None = Field(default=None, ge=MIN_DEADLINE, le=MAX_DEADLINE)
    key: str | None = Field(default=None, pattern=r"^[0-9a-z][0-9a-z-]{0,23}$")
    """A name for the task inside the batch (default: its line number)."""
    attempts: int | None = Field(default=None, ge=1, le=8)
    """Best-of-N: run this many attempts of the task on its node as one group; the
    group's pick is the task's result (``agentbox/<attempt>``)."""
    budget_split: Literal["split", "shared"] = "split"
    """With ``attempts``: the task's budget divided between them, or shared by them."""


class Attempt(_Strict):
    """One try at one task, as a node receives it. The id is the node's task id."""

    attempt_id: str = Field(pattern=r"^[0-9a-z-]{1,64}$")
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS)
    model: str | None = None
    budget: int = Field(ge=1, le=MAX_BUDGET)
    deadline: float = Field(ge=MIN_DEADLINE, le=MAX_DEADLINE)
    base: str = Field(pattern=r"^[0-9a-f]{40}$")
    """The base commit, inside the input bundle."""
    boxfile: dict[str, Any] | None = None
    attempts: int = Field(default=1, ge=1, le=8)
    """More than 1: a best-of-N group on the node, whose pick is the outcome."""
    budget_split: Literal["split", "shared"] = "split"


class NodeOutcome(_Strict):
    """What a node sends back for an attempt (untrusted on the driver)."""

    attempt_id: str = Field(pattern=r"^[0-9a-z-]{1,64}$")
    node: str = Field(max_length=128)
    status: Literal["done", "failed", "timed_out", "cancelled"]
    commit: str = Field(default="", pattern=r"^([0-9a-f]{40})?$")
    bundle: bytes = Field(default=b"", max_length=MAX_RESULT_BUNDLE)
    """The result branch ``agentbox/<attempt>`` as a git bundle, prerequisite the base."""
    tokens: int = Field(default=0, ge=0)
    report: dict[str, Any] = Field(default_factory=dict)
    transcript: str = Field(default="", max_length=8 * 1024 * 1024)
    """The tail of the transcript (JSON of a TranscriptPage)."""
    error: str = Field(default="", max_length=4000)
    group: dict[str, Any] | None = None
    """A best-of-N attempt: the node's group view (:class:`~agentbox.launcher.attempts.
    GroupView` as JSON: every attempt's score and the pick), re-validated by the driver."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase on the node: ``unbundle``; ``queued`` (submitted until the sandbox
    started: the launcher's queue, the workspace, the gateway); ``task`` (the sandbox started
    until finished); ``run`` (submitted until finished); ``bundle``. And the unix times the
    node got the attempt (``received_at``) and sent its outcome (``done_at``)."""


class BatchResult(_Strict):
    """One task's end, as :func:`agentbox.cluster.run_batch` yields it."""

    key: str
    attempt_id: str
    status: Literal["done", "failed", "timed_out", "cancelled", "skipped"]
    node: str = ""
    branch: str = ""
    """``agentbox/<attempt>`` in the driver's repo; "" when there was nothing to publish."""
    commit: str = ""
    tokens: int = 0
    error: str = ""
    lost_attempts: tuple[str, ...] = ()
    """Attempts that died with their node; their partial results were discarded."""
    resumed: bool = False
    """Finished in an earlier run of the same batch (not re-run, not re-fetched)."""
    pick: int | None = None
    """A best-of-N task: the attempt (1-based) the node's group picked; None: none, or a
    task of one attempt."""
    group: dict[str, Any] | None = None
    """A best-of-N task: its group (ids, statuses, tests, diff sizes, tokens, the pick)."""
    flagged: tuple[str, ...] = ()
    """Paths of the published branch that make other tools run code (``.envrc``,
    ``.claude/`` …), found by the driver in the fetched tree, never taken from the node."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase of the attempt: on the node (see :attr:`NodeOutcome.timings`);
    placed to the node's receipt (``placement``: Ray's scheduling, the wait for a free
    slot, the bundle's transfer), the outcome's way back (``return``), placed to outcome
    (``total``), fetching and publishing on the driver (``publish``). ``placement`` and
    ``return`` compare two hosts' clocks: exact on one host, skewed across hosts."""


class BatchEvent(_Strict):
    """One line of ``agentbox batch run --json``."""

    event: Literal[
        "batch",
        "placed",
        "finished",
        "group",
        "lost",
        "published",
        "pull_request",
        "skipped",
        "end",
    ]
    batch: str
    key: str = ""
    attempt_id: str = ""
    node: str = ""
    status: str = ""
    tokens: int = 0
    detail: str = ""


def read_tasks(path: Path) -> Iterator[tuple[str, BatchTask]]:
    """``(key, task)`` per non-blank line of a tasks file; ConfigError names the bad line."""
    try:
        fh = Path(path).open(encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise ConfigError(f"cannot read the tasks file {path}: {exc.strerror}") from exc
    keys: set[str] = set()
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if len(line) > _MAX_LINE:
                raise ConfigError(f"{path}:{n}: line longer than {_MAX_LINE} characters")
            try:
                task = BatchTask.model_validate(json.loads(line))
            except (ValueError, ValidationError) as exc:
                raise ConfigError(f"{path}:{n}: not a task: {str(exc)[:300]}") from exc
            key = task.key or f"t{n}"
            if key in keys:
                raise ConfigError(f"{path}:{n}: the key {key!r} is used twice")
            keys.add(key)
            yield key, task
