"""Best-of-N: a task group of N attempts, each scored from what agentbox knows, one picked.

A group (``agentbox run --attempts N``) is N tasks of the same request, ids
``<group>-a1`` … ``<group>-aN``, each with its own sandbox, gateway and branch
(``agentbox/<group>-aK``); the pick is also published as ``agentbox/<group>``.

Each attempt is scored from its report only (nothing the agent says about
itself): whether it ended ``done``, its last test command and that command's
exit code (Claude Code's Bash tool result, parsed by :mod:`agentbox.transcript`),
the diff's size (lines inserted + deleted), the paths flagged as able to run
code, tokens, cost and wall time.

The pick (:func:`pick`), ``by="tests"`` (the default):

1. among the attempts that ended ``done`` with a result commit, those whose last
   test command exited 0; of these the smallest diff (ties: the lower index);
2. if none passed its tests: those that ended ``done`` with a result commit and
   ran no test command, the smallest diff;
3. otherwise no pick (an attempt whose tests failed is never picked by default).

``by="diff"``, ``"tokens"``, ``"cost"``, ``"time"``: among the attempts that ended
``done`` with a result commit, the least of that measure (ties: tests passed first,
then the lower index). ``agentbox publish GROUP --pick K`` overrides any rule.

Everything here is pure: the CLI, the SDK and the tests call it on
:class:`~agentbox.launcher.api.TaskInfo` and :class:`~agentbox.launcher.api.TaskResult`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.core.wire import TokenUsage

__all__ = [
    "ATTEMPT_ID",
    "MAX_ATTEMPTS",
    "PICK_RULES",
    "AttemptScore",
    "GroupView",
    "PickBy",
    "attempt_id",
    "budget_share",
    "group_of",
    "pick",
    "score",
]

#: The most attempts of one group.
MAX_ATTEMPTS = 8
#: An attempt's task id: ``<group>-a<K>``.
ATTEMPT_ID = re.compile(r"^(?P<group>[0-9a-z-]{1,60})-a(?P<k>[1-8])$")

PickBy = Literal["tests", "diff", "tokens", "cost", "time"]
PICK_RULES: tuple[str, ...] = ("tests", "diff", "tokens", "cost", "time")


def attempt_id(group: str, k: int) -> str:
    """The task id of attempt ``k`` (1-based) of ``group``."""
    if not 1 <= k <= MAX_ATTEMPTS:
        raise ValueError(f"attempt {k} out of 1..{MAX_ATTEMPTS}")
    return f"{group}-a{k}"


def group_of(task_id: str) -> tuple[str, int] | None:
    """``(group, k)`` of an attempt's id, or None."""
    m = ATTEMPT_ID.match(task_id)
    return (m["group"], int(m["k"])) if m else None


def budget_share(budget: int, n: int) -> list[int]:
    """``budget`` tokens split over ``n`` attempts: each ``budget // n`` (never more than
    the group's in total; the remainder is left unspent rather than given to one)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    share = budget // n
    if share < 1:
        raise ValueError(f"a budget of {budget} tokens cannot be split over {n} attempts")
    return [share] * n


class AttemptScore(BaseModel):
    """What agentbox knows of one attempt (the row of ``agentbox show GROUP``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int
    id: str
    status: str
    branch: str | None = None
    commit: str = ""
    test_command: str | None = None
    """The last test command the agent ran (None: none)."""
    test_exit: int | None = None
    tests_passed: bool | None = None
    """True: its last test command exited 0; False: non-zero; None: no test ran."""
    diff_lines: int = 0
    """Lines inserted + deleted."""
    files_changed: int = 0
    flagged: int = 0
    """Paths flagged as able to run code (hooks, settings, CI, …)."""
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    cost_usd: float | None = None
    duration_s: float | None = None

    @property
    def eligible(self) -> bool:
        """Ended ``done`` with a result commit: something to publish."""
        return self.status == "done" and bool(self.commit)


def score(attempt: int, info: Any, result: Any | None) -> AttemptScore:
    """The score of one attempt from its :class:`TaskInfo` and (once finished) its
    :class:`TaskResult` (None: not finished, or nothing collected)."""
    report: dict[str, Any] = dict(result.report) if result is not None else {}
    last = report.get("last_test_command")
    command = exit_code = None
    if isinstance(last, dict):
        command = last.get("command") if isinstance(last.get("command"), str) else None
        code = last.get("exit_code")
        exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
    stat = report.get("diffstat") if isinstance(report.get("diffstat"), dict) else {}
    assert isinstance(stat, dict)
    flagged = report.get("flagged")
    duration = report.get("duration_s")
    if not isinstance(duration, int | float):
        start, end = getattr(info, "started_at", None), getattr(info, "finished_at", None)
        duration = (end - start) if start is not None and end is not None else None
    return AttemptScore(
        attempt=attempt,
        id=info.id,
        status=info.status,
        branch=(result.branch or None) if result is not None else info.branch,
        commit=result.commit if result is not None else "",
        test_command=command,
        test_exit=exit_code,
        tests_passed=None if command is None else exit_code == 0,
        diff_lines=_int(stat.get("insertions")) + _int(stat.get("deletions")),
        files_changed=_int(stat.get("files_changed")),
        flagged=len(flagged) if isinstance(flagged, list) else 0,
        tokens=result.tokens if result is not None else info.tokens,
        cost_usd=result.cost_usd if result is not None else None,
        duration_s=float(duration) if duration is not None else None,
    )


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def pick(scores: list[AttemptScore], by: str = "tests") -> AttemptScore | None:
    """The group's pick by rule ``by`` (see the module's docs), or None."""
    if by not in PICK_RULES:
        raise ValueError(f"--pick-by must be one of {', '.join(PICK_RULES)}, not {by!r}")
    done = [s for s in scores if s.eligible]
    if by == "tests":
        for tier in (
            [s for s in done if s.tests_passed is True],
            [s for s in done if s.tests_passed is None],
        ):
            if tier:
                return min(tier, key=lambda s: (s.diff_lines, s.attempt))
        return None
    if not done:
        return None

    def measure(s: AttemptScore) -> float:
        if by == "diff":
            return float(s.diff_lines)
        if by == "tokens":
            return float(s.tokens.total)
        if by == "cost":
            return s.cost_usd if s.cost_usd is not None else float("inf")
        return s.duration_s if s.duration_s is not None else float("inf")

    return min(done, key=lambda s: (measure(s), s.tests_passed is not True, s.attempt))


class GroupView(BaseModel):
    """A group, its attempts and its pick (``run --attempts N --json``, ``show GROUP --json``)."""

    model_config = ConfigDict(extra="forbid")

    group: str
    repo: str = ""
    pick_by: str = "tests"
    attempts: list[AttemptScore]
    pick: int | None = None
    """The picked attempt's index (1-based), None when none qualifies."""
    pick_id: str | None = None
    branch: str | None = None
    """``agentbox/<group>`` once the pick is published."""
    budget_split: Literal["split", "shared"] = "split"
    """``split``: each attempt had ``budget // N``; ``shared``: all drew from one budget."""
    group_spent: float | None = None
    """Shared: the weighted tokens the attempts charged together (never over the budget)."""
