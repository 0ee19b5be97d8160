"""The ordering rules of ``backends/podman/_removals.py`` (no podman, no process: the
remover's start is recorded instead).

The real removal and rename run in tests/integration/test_podman_removal.py and
test_podman_pool.py; here only what waits for what, and what a failed rename does.
"""

from __future__ import annotations

import threading

import pytest

from agentbox.backends.podman import _removals
from agentbox.errors import CommandError


class _Ended:
    """What ``_watch`` reads of a remover that exited 0."""

    returncode = 0

    def communicate(self) -> tuple[bytes, bytes]:
        return b"", b""


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def spawn(name: str, after: object) -> _Ended:
        calls.append(name)
        return _Ended()

    monkeypatch.setattr(_removals, "_spawn", spawn)
    return calls


@pytest.fixture
def removed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(_removals, "force_remove", calls.append)
    return calls


def test_a_removal_starts_only_after_a_rename_to_the_same_name(spawned: list[str]) -> None:
    gate = threading.Event()
    _removals.rename_later("box-a", "cid-a", lambda: gate.wait(30))
    _removals.remove_later("box-a")
    assert not _removals.wait("box-a", 0.2), "the removal did not wait for the rename"
    assert spawned == [] and _removals.pending() == ["box-a"]
    gate.set()
    assert _removals.wait("box-a", 30)
    assert spawned == ["box-a"] and _removals.pending() == []


def test_the_remover_is_started_off_the_callers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """remove_later returns before the remover's process is started (a thread starts it);
    that thread is no daemon, so a process ending meanwhile waits for the start; and
    wait() follows the removal from that thread to the one that watches the remover."""
    started, finish = threading.Event(), threading.Event()
    calls: list[str] = []

    class Running:
        returncode = 0

        def communicate(self) -> tuple[bytes, bytes]:
            finish.wait(30)
            return b"", b""

    def spawn(name: str, fd: int) -> Running:
        started.wait(30)
        calls.append(name)
        return Running()

    monkeypatch.setattr(_removals, "_spawn", spawn)
    _removals.remove_later("box-c")
    assert calls == [], "remove_later waited for the remover's start"
    starters = [t for t in threading.enumerate() if t.name == "agentbox-rm-start-box-c"]
    assert starters and not starters[0].daemon, "a process could end before the remover started"
    assert _removals.pending() == ["box-c"]
    started.set()
    assert not _removals.wait("box-c", 0.3), "wait() returned while the remover still ran"
    assert calls == ["box-c"]
    finish.set()
    assert _removals.wait("box-c", 30) and _removals.pending() == []


def test_a_failed_rename_removes_the_container_by_its_id(removed: list[str]) -> None:
    def rename() -> None:
        raise CommandError(["podman", "rename"], 125, "Error: name in use")

    _removals.rename_later("box-b", "cid-b", rename)
    _removals.await_rename("box-b")
    assert removed == ["cid-b"]


def test_await_rename_of_a_name_without_one_returns_at_once() -> None:
    _removals.await_rename("box-none", timeout=0)  # nothing pending: no wait, no error
    assert _removals.wait("box-none", 0)
