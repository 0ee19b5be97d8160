"""Best-of-N scoring and the pick (pure): agentbox.launcher.attempts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agentbox.core.wire import TokenUsage
from agentbox.launcher.attempts import (
    AttemptScore,
    attempt_id,
    budget_share,
    group_of,
    pick,
    score,
)


def _score(k: int, *, status: str = "done", passed: bool | None = True, lines: int = 10,
           tokens: int = 100, cost: float | None = None, secs: float = 5.0,
           commit: str = "c") -> AttemptScore:  # fmt: skip
    return AttemptScore(
        attempt=k,
        id=f"g-a{k}",
        status=status,
        commit=commit,
        test_command=None if passed is None else "pytest -q",
        test_exit=None if passed is None else (0 if passed else 1),
        tests_passed=passed,
        diff_lines=lines,
        tokens=TokenUsage(input=tokens),
        cost_usd=cost,
        duration_s=secs,
    )


def test_ids_round_trip() -> None:
    assert attempt_id("t-abc", 3) == "t-abc-a3"
    assert group_of("t-abc-a3") == ("t-abc", 3)
    assert group_of("t-abc") is None
    with pytest.raises(ValueError):
        attempt_id("g", 9)


def test_budget_split_never_exceeds_the_group() -> None:
    for budget in (1000, 1001, 20_000_000, 7):
        for n in range(1, 8):
            if budget // n == 0:
                continue
            shares = budget_share(budget, n)
            assert len(shares) == n and sum(shares) <= budget
    with pytest.raises(ValueError):
        budget_share(2, 3)


def test_pick_passing_tests_then_smallest_diff() -> None:
    scores = [
        _score(1, passed=False, lines=1),  # smallest diff, but its tests fail
        _score(2, passed=True, lines=30),
        _score(3, passed=True, lines=12),
    ]
    chosen = pick(scores)
    assert chosen is not None and chosen.attempt == 3


def test_pick_ties_go_to_the_lower_index() -> None:
    chosen = pick([_score(1, lines=5), _score(2, lines=5)])
    assert chosen is not None and chosen.attempt == 1


def test_failed_tests_are_never_picked_by_default() -> None:
    assert pick([_score(1, passed=False), _score(2, passed=False)]) is None
    # no test ran at all: the smallest done diff
    chosen = pick([_score(1, passed=False, lines=1), _score(2, passed=None, lines=9)])
    assert chosen is not None and chosen.attempt == 2


def test_not_done_or_no_commit_is_not_eligible() -> None:
    scores = [_score(1, status="failed", lines=1), _score(2, commit="", lines=2),
              _score(3, status="timed_out"), _score(4, lines=50)]  # fmt: skip
    chosen = pick(scores)
    assert chosen is not None and chosen.attempt == 4


def test_other_rules() -> None:
    scores = [_score(1, lines=50, tokens=10, cost=3.0, secs=9),
              _score(2, lines=5, tokens=900, cost=1.0, secs=1)]  # fmt: skip
    assert pick(scores, "tokens").attempt == 1  # type: ignore[union-attr]
    assert pick(scores, "diff").attempt == 2  # type: ignore[union-attr]
    assert pick(scores, "cost").attempt == 2  # type: ignore[union-attr]
    assert pick(scores, "time").attempt == 2  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        pick(scores, "vibes")


def _info(**kw: Any) -> Any:
    base = dict(id="g-a2", status="done", branch=None, tokens=TokenUsage(),
                started_at=10.0, finished_at=25.0)  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_score_reads_the_report() -> None:
    report = {
        "last_test_command": {"command": "python3 -m pytest -q", "exit_code": 1},
        "diffstat": {"files_changed": 2, "insertions": 7, "deletions": 3},
        "flagged": [{"path": ".claude/settings.json"}],
        "duration_s": 12.5,
    }
    res = SimpleNamespace(report=report, branch="agentbox/g-a2", commit="abc",
                          tokens=TokenUsage(input=5, output=6), cost_usd=0.25)  # fmt: skip
    s = score(2, _info(), res)
    assert (s.attempt, s.test_exit, s.tests_passed) == (2, 1, False)
    assert (s.diff_lines, s.files_changed, s.flagged) == (10, 2, 1)
    assert s.tokens.total == 11 and s.cost_usd == 0.25 and s.duration_s == 12.5
    assert s.branch == "agentbox/g-a2" and s.eligible


def test_score_of_an_unfinished_attempt() -> None:
    s = score(1, _info(status="running", finished_at=None), None)
    assert s.tests_passed is None and not s.eligible and s.duration_s is None


def test_a_hostile_report_scores_nothing() -> None:
    report = {"last_test_command": {"command": 5, "exit_code": True},
              "diffstat": "lots", "flagged": "no"}  # fmt: skip
    res = SimpleNamespace(report=report, branch="", commit="", tokens=TokenUsage(), cost_usd=None)
    s = score(1, _info(), res)
    assert s.test_command is None and s.tests_passed is None
    assert (s.diff_lines, s.flagged) == (0, 0)


def test_a_group_request_names_its_budget_split() -> None:
    """``split`` is the default (and left out of the body: a launcher that predates the
    field still answers); ``shared`` is sent; anything else is refused before sending."""
    from pydantic import ValidationError

    from agentbox.errors import RefusedError
    from agentbox.launcher._groupbudget import check_split
    from agentbox.launcher.api import GroupRequest, TaskRequest

    req = TaskRequest(repo="/r", task="t")
    assert GroupRequest(request=req, attempts=2).budget_split == "split"
    shared = GroupRequest.model_validate({"request": req, "attempts": 2, "budget_split": "shared"})
    assert shared.budget_split == "shared"
    with pytest.raises(ValidationError):
        GroupRequest.model_validate({"request": req, "attempts": 2, "budget_split": "half"})
    assert check_split("shared") == "shared" and check_split("split") == "split"
    with pytest.raises(RefusedError):
        check_split("half")
