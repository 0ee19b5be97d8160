"""The SQLite task store: compare-and-set transitions, owners, shared between connections."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentbox.errors import TaskIdRefused, TaskNotFound
from agentbox.launcher._store import Owner, Store
from agentbox.launcher.api import TokenUsage


def _insert(store: Store, task_id: str = "t-1", status: str = "queued") -> None:
    store.insert(
        id=task_id, status=status, repo="/r", task="x", model="m", budget=10, deadline=10.0,
        created_at=1.0, owner_pid=os.getpid(), owner_start=Owner.me().start,
    )  # fmt: skip


def test_roundtrip_and_info(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    _insert(store)
    assert store.exists("t-1") and not store.exists("t-2")
    store.update("t-1", tokens=TokenUsage(input=3, output=4))
    info = store.get("t-1").info()
    assert info.status == "queued" and info.tokens.total == 7
    with pytest.raises(TaskNotFound):
        store.get("t-2")
    with pytest.raises(TaskIdRefused):
        _insert(store)
    assert (tmp_path / "state.db").stat().st_mode & 0o777 == 0o600


def test_finish_is_compare_and_set(tmp_path: Path) -> None:
    """Of many racing finishers exactly one wins; a terminal task never changes again."""
    store = Store(tmp_path / "state.db")
    _insert(store)
    wins: list[str] = []
    barrier = threading.Barrier(8)

    def race(status: str) -> None:
        barrier.wait()
        if Store(tmp_path / "state.db").finish("t-1", status):
            wins.append(status)

    threads = [
        threading.Thread(target=race, args=(s,))
        for s in ["done", "failed", "cancelled", "timed_out"] * 2
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("t-1").status == wins[0]
    assert not store.finish("t-1", "done" if wins[0] != "done" else "failed")
    assert not store.update("t-1", expect={"queued"}, status="running")


def test_owner_liveness_survives_pid_reuse_checks() -> None:
    me = Owner.me()
    assert me.alive()
    assert not Owner(me.pid, me.start + 100).alive()  # same pid, another process
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = Owner.of(proc.pid)
    proc.wait()
    assert owner is not None and not owner.alive()


def test_public_surface_is_pinned() -> None:
    import agentbox.launcher as pkg

    assert set(pkg.__all__) == {
        "Launcher", "LauncherClient", "ModelInfo", "TaskInfo", "TaskRequest", "TaskResult",
        "TaskStatus", "TokenUsage",
    }  # fmt: skip
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None


def test_agent_log_is_capped(tmp_path: Path) -> None:
    from agentbox.launcher._runner import _sink

    with (tmp_path / "log").open("wb") as fh:
        write = _sink(fh, limit=10)
        for _ in range(5):
            write(b"0123456")
    data = (tmp_path / "log").read_bytes()
    assert data.startswith(b"0123456012\n[agentbox: output past this point dropped")
    assert data.count(b"dropped") == 1


def test_only_one_reconciler_claims_an_orphan(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    _insert(store)
    old = store.get("t-1").owner
    a, b = Owner(111, 1.0), Owner(222, 2.0)
    assert store.claim("t-1", old, a)
    assert not store.claim("t-1", old, b)
    assert store.get("t-1").owner == a
