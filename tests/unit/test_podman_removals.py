"""The ordering rules of ``backends/podman/_removals.py`` (no podman: its calls recorded).

The real removal and rename run in tests/integration/test_podman_removal.py and
test_podman_pool.py; here only what waits for what, and what a failed rename does.
"""

from __future__ import annotations

import threading

import pytest

from agentbox.backends.podman import _removals
from agentbox.errors import CommandError


@pytest.fixture
def removed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(_removals, "force_remove", calls.append)
    return calls


def test_a_removal_waits_for_a_rename_to_the_same_name(removed: list[str]) -> None:
    gate = threading.Event()
    order: list[str] = []

    def rename() -> None:
        gate.wait(30)
        order.append("renamed")

    _removals.rename_later("box-a", "cid-a", rename)
    _removals.remove_later("box-a")
    assert not _removals.wait("box-a", 0.2), "the removal did not wait for the rename"
    assert removed == [] and _removals.pending() == ["box-a"]
    gate.set()
    assert _removals.wait("box-a", 30)
    assert order == ["renamed"] and removed == ["box-a"]
    assert _removals.pending() == []


def test_a_failed_rename_removes_the_container_by_its_id(removed: list[str]) -> None:
    def rename() -> None:
        raise CommandError(["podman", "rename"], 125, "Error: name in use")

    _removals.rename_later("box-b", "cid-b", rename)
    _removals.await_rename("box-b")
    assert removed == ["cid-b"]


def test_await_rename_of_a_name_without_one_returns_at_once() -> None:
    _removals.await_rename("box-none", timeout=0)  # nothing pending: no wait, no error
    assert _removals.wait("box-none", 0)
