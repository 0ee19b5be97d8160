"""Per-caller scoping of the in-process launcher API, and the store's migration to it.

The socket server passes the peer's uid as ``caller``; these tests call the same
methods directly with uids (no socket, no privileges), on a real SQLite store,
including one written by a version from before ``caller_uid`` existed.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.errors import TaskNotFound
from agentbox.launcher import Launcher
from agentbox.launcher._store import Store

#: The tasks table as the first releases wrote it (no phase, changed or caller_uid).
_OLD_SCHEMA = """
CREATE TABLE tasks (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, repo TEXT NOT NULL, task TEXT NOT NULL,
    model TEXT NOT NULL, budget INTEGER NOT NULL, deadline REAL NOT NULL,
    include_uncommitted INTEGER NOT NULL DEFAULT 0, publish INTEGER NOT NULL DEFAULT 1,
    boxfile TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    exit_code INTEGER, tokens TEXT, branch TEXT, commit_id TEXT, error TEXT, sandbox TEXT,
    backend TEXT, owner_pid INTEGER, owner_start REAL, gateway_pid INTEGER,
    gateway_start REAL, watchdog_pid INTEGER, cancel_requested INTEGER NOT NULL DEFAULT 0
);
"""


def _row(store: Store, task_id: str, uid: int | None, status: str = "done") -> None:
    store.insert(
        id=task_id, status=status, repo="/r", task="x", model="replay-demo", budget=5,
        deadline=10.0, created_at=time.time(), caller_uid=uid,
    )  # fmt: skip


def test_an_old_database_gains_the_column_and_its_tasks_are_roots(settings: Settings) -> None:
    db = settings.data_dir / "state.db"
    with sqlite3.connect(db) as con:
        con.executescript(_OLD_SCHEMA)
        con.execute(
            "INSERT INTO tasks (id, status, repo, task, model, budget, deadline, created_at) "
            "VALUES ('old-1', 'done', '/r', 'x', 'replay-demo', 5, 10.0, 1.0)"
        )
    with Launcher(settings) as launcher:
        assert launcher.store.get("old-1").caller_uid is None
        assert [t.id for t in launcher.list(caller=0)] == ["old-1"]
        assert launcher.list() and launcher.get("old-1").uid is None
        assert launcher.list(caller=1000) == []
        for call in (launcher.get, launcher.result, launcher.cancel, launcher.transcript):
            with pytest.raises(TaskNotFound):
                call("old-1", caller=1000)
        assert launcher.transcript("old-1", caller=0).task_id == "old-1"
        _row(launcher.store, "new-1", 1000)
        assert [t.id for t in launcher.list(caller=1000)] == ["new-1"]


def test_each_caller_sees_only_its_own(settings: Settings) -> None:
    with Launcher(settings) as launcher:
        _row(launcher.store, "a-1", 1001)
        _row(launcher.store, "b-1", 1002, status="running")
        assert {t.id for t in launcher.list(caller=1001)} == {"a-1"}
        assert {t.id for t in launcher.list(caller=1002)} == {"b-1"}
        assert {t.id for t in launcher.list(caller=0)} == {"a-1", "b-1"}
        assert launcher.get("a-1", caller=1001).uid == 1001
        assert launcher.result("a-1", caller=1001).task_id == "a-1"
        with pytest.raises(TaskNotFound, match="no such task"):
            launcher.cancel("b-1", caller=1001)
        assert launcher.get("b-1").status == "running"
        assert not launcher.store.get("b-1").cancel_requested
        with pytest.raises(TaskNotFound):
            launcher.wait("b-1", 0.1, caller=1001)


def test_a_fresh_store_has_the_column(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    _row(store, "t-1", 7)
    assert store.get("t-1").caller_uid == 7
    assert [r.id for r in store.all(caller_uid=7)] == ["t-1"]
    assert store.all(caller_uid=8) == []
