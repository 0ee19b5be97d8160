"""A best-of-N group's shared budget (``--budget-split shared``): N ledgers, one file.

Each ledger stands for one attempt's gateway; they hold the same file through their
own descriptors (as separate gateway processes do), so ``flock`` serialises them."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from agentbox.errors import Refusal
from agentbox.gateway._budget import GROUP_BUDGET_FILE, Ledger, open_group_share
from agentbox.gateway._meter import TokenCount

BUDGET = 60_000


def _group(tmp_path: Path, n: int) -> list[Ledger]:
    (tmp_path / GROUP_BUDGET_FILE).write_text(json.dumps({"budget": BUDGET, "slots": {}}))
    ledgers = []
    for _ in range(n):
        dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            share = open_group_share(dir_fd)
        finally:
            os.close(dir_fd)
        assert share is not None
        ledgers.append(Ledger(budget=BUDGET, model="m", shared=share))
    return ledgers


def _slots_total(tmp_path: Path) -> float:
    slots = json.loads((tmp_path / GROUP_BUDGET_FILE).read_text())["slots"]
    return sum(v[0] + v[1] for v in slots.values())


def test_no_group_file_no_share(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert open_group_share(dir_fd) is None
    finally:
        os.close(dir_fd)


def test_attempts_that_would_overspend_never_pass_the_groups_budget(tmp_path: Path) -> None:
    """Three attempts each wanting ~40k tokens (120k together) on a 60k group budget:
    interleaved requests, every one charged what it was allowed; the group's total
    (charged + held) never passes 60k, and the attempts are refused once it is spent."""
    ledgers = _group(tmp_path, 3)
    rng = random.Random(7)
    held: list[tuple[Ledger, object]] = []
    refused = 0
    wanted = 0
    for _ in range(60):
        led = rng.choice(ledgers)
        if held and rng.random() < 0.5:
            owner, r = held.pop(rng.randrange(len(held)))
            assert isinstance(owner, Ledger)
            # The upstream answers within what was allowed: input within the estimate.
            owner.settle(r, TokenCount(input=1500, output=r.max_tokens // 2), complete=True)  # type: ignore[arg-type]
        else:
            wanted += 1500 + 2000
            try:
                held.append((led, led.reserve(body_len=1000, max_tokens=4000)))
            except Refusal:
                refused += 1
        total = sum(x.usage.weighted_total + x.usage.reserved for x in ledgers)
        assert total <= BUDGET, total
        assert _slots_total(tmp_path) <= BUDGET
    for owner, r in held:
        owner.settle(r, None, complete=False)  # dropped: the worst case stays charged
    spent = sum(x.usage.weighted_total for x in ledgers)
    assert spent <= BUDGET
    assert wanted > BUDGET and refused > 0  # they would have overspent, and were stopped
    # What is left is less than one more request's worst case: the group is spent.
    assert BUDGET - spent < 1512 * 1.25 + 4000


def test_the_others_spend_counts(tmp_path: Path) -> None:
    a, b = _group(tmp_path, 2)
    r = a.reserve(body_len=100, max_tokens=50_000)
    a.settle(r, TokenCount(input=600, output=50_000), complete=True)  # a: 50,600 spent
    # b spent nothing itself; its max_tokens is clamped to what the group has left.
    held = b.reserve(body_len=100, max_tokens=10_000)
    assert held.clamped and held.max_tokens == BUDGET - 50_600 - 765
    with pytest.raises(Refusal) as e:
        a.reserve(body_len=100, max_tokens=3000)  # b holds the rest
    assert e.value.reason == "over_budget" and not a.usage.exhausted  # b's may come back
    b.release(held)
    assert a.reserve(body_len=100, max_tokens=3000).max_tokens == 3000


def test_an_unreadable_group_file_spends_everything(tmp_path: Path) -> None:
    (a,) = _group(tmp_path, 1)
    (tmp_path / GROUP_BUDGET_FILE).write_text("{not json")
    with pytest.raises(Refusal):
        a.reserve(body_len=100, max_tokens=3000)


def test_a_gone_holders_hold_becomes_charged_and_a_live_ones_stays(tmp_path: Path) -> None:
    """Slots whose holder ended (here: this process's pid with another start time, as a
    pid reused is) are reclaimed by the next ledger to take the lock: held becomes
    charged, tokens and dollars; a live holder's, a holderless one's and a malformed
    holder's stay as they are (nothing reclaimed on a doubt)."""
    from agentbox.gateway._budget import _start_time

    me, start = os.getpid(), _start_time(os.getpid())
    assert start is not None
    doc = {
        "budget": BUDGET,
        "slots": {
            "gone": [100.0, 5000.0, 0.5, 0.25],
            "live": [100.0, 5000.0, 0.0, 0.0],
            "old": [100.0, 5000.0, 0.0, 0.0],
            "odd": [100.0, 5000.0, 0.0, 0.0],
        },
        "holders": {"gone": [me, start + 1], "live": [me, start], "odd": ["1", True]},
    }
    (tmp_path / GROUP_BUDGET_FILE).write_text(json.dumps(doc))
    (led,) = _open(tmp_path)
    got = json.loads((tmp_path / GROUP_BUDGET_FILE).read_text())
    assert got["slots"]["gone"] == [5100.0, 0.0, 0.75, 0.0]
    assert "gone" not in got["holders"]
    for key in ("live", "old", "odd"):
        assert got["slots"][key] == [100.0, 5000.0, 0.0, 0.0]
    # What the ledger sees: the gone one's hold is spent, no longer in flight.
    assert led.shared is not None
    assert led.shared.others == (5400.0, 15000.0, 0.75, 0.0)
    # Its own slot names it as holder once it writes.
    led.release(led.reserve(body_len=100, max_tokens=2048))
    holders = json.loads((tmp_path / GROUP_BUDGET_FILE).read_text())["holders"]
    assert holders[led.shared.key] == [me, start]


def _open(tmp_path: Path) -> list[Ledger]:
    """One ledger on the group file already in ``tmp_path`` (as a gateway opens it)."""
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        share = open_group_share(dir_fd)
    finally:
        os.close(dir_fd)
    assert share is not None
    return [Ledger(budget=BUDGET, model="m", shared=share)]
