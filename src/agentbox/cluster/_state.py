"""A batch's state on the driver: one SQLite file, so a killed driver resumes.

One row per task (its key in the batch), holding where it stands::

    queued ─▶ placed ─▶ collected ─▶ published
      │ ▲        │            (a terminal status: done | failed | timed_out | cancelled)
      │ └─ lost ─┘ (its node died: a new attempt id, the old one reported)
      ├─▶ skipped (the batch budget could not cover it, or the batch was cancelled)
      └─▶ failed (a node refused or failed the attempt itself: nothing to collect)

``collected`` means the result (bundle, report, transcript) is saved in the
batch dir; ``published`` that its branch is in the driver's repo. A resumed
driver re-runs nothing past ``collected`` and re-fetches nothing ``published``.
The batch-level budget is kept here too: a task's budget is reserved before it
is placed, settled to what it used when it ends, and kept whole when its node
died (what the lost attempt spent is unknown), so the batch never exceeds it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.errors import ConfigError, TaskError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch (
  id TEXT PRIMARY KEY, created_at REAL NOT NULL, budget INTEGER,
  cancel_requested INTEGER NOT NULL DEFAULT 0, options TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS tasks (
  key TEXT PRIMARY KEY, seq INTEGER NOT NULL, spec TEXT NOT NULL, repo TEXT NOT NULL,
  base TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'queued', attempt INTEGER NOT NULL DEFAULT 0,
  attempt_id TEXT NOT NULL DEFAULT '', node TEXT NOT NULL DEFAULT '',
  status TEXT NOT NULL DEFAULT '', commit_id TEXT NOT NULL DEFAULT '',
  branch TEXT NOT NULL DEFAULT '', tokens INTEGER NOT NULL DEFAULT 0,
  reserved INTEGER NOT NULL DEFAULT 0, lost_charge INTEGER NOT NULL DEFAULT 0,
  lost TEXT NOT NULL DEFAULT '[]', error TEXT NOT NULL DEFAULT '', updated_at REAL NOT NULL
);
"""

#: Task states in which nothing runs and nothing remains to do.
FINAL = frozenset({"published", "skipped", "failed"})


@dataclass(frozen=True)
class TaskRow:
    """One task of the batch, as stored."""

    key: str
    seq: int
    spec: dict[str, Any]
    repo: str
    base: str
    state: str
    attempt: int
    attempt_id: str
    node: str
    status: str
    commit: str
    branch: str
    tokens: int
    reserved: int
    lost_charge: int
    lost: tuple[str, ...]
    error: str
    cost_usd: float | None = None
    """US dollars at the model's prices, as the node's report said; None: unknown."""


class BatchState:
    """The SQLite file of one batch. Thread-safe; every write is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(tasks)")}
        if "cost_usd" not in have:  # added after the first schema: a batch file of before
            self._db.execute("ALTER TABLE tasks ADD COLUMN cost_usd REAL")
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the file; idempotent."""
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- the batch ---------------------------------------------------------

    def init(self, batch_id: str, *, budget: int | None, options: dict[str, Any]) -> bool:
        """Record the batch; False when it already existed (a resume)."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM batch WHERE id=?", (batch_id,)).fetchone():
                return False
            db.execute(
                "INSERT INTO batch (id, created_at, budget, options) VALUES (?,?,?,?)",
                (batch_id, time.time(), budget, json.dumps(options)),
            )
            return True

    def batch(self) -> dict[str, Any]:
        """The batch row (id, created_at, budget, cancel_requested, options)."""
        row = self._db.execute(
            "SELECT id, created_at, budget, cancel_requested, options FROM batch"
        ).fetchone()
        if row is None:
            raise ConfigError(f"{self.path} holds no batch")
        return {"id": row[0], "created_at": row[1], "budget": row[2],
                "cancel_requested": bool(row[3]), "options": json.loads(row[4])}  # fmt: skip

    def request_cancel(self) -> None:
        """Ask the driver running this batch to stop (it polls)."""
        with self._tx() as db:
            db.execute("UPDATE batch SET cancel_requested=1")

    def cancel_requested(self) -> bool:
        row = self._db.execute("SELECT cancel_requested FROM batch").fetchone()
        return bool(row and row[0])

    # -- tasks -------------------------------------------------------------

    def add_task(self, key: str, seq: int, spec: dict[str, Any], repo: str, base: str) -> None:
        """Record a task unless it is there already (a resume keeps the stored one)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO tasks (key, seq, spec, repo, base, updated_at)"
                " VALUES (?,?,?,?,?,?)",
                (key, seq, json.dumps(spec), repo, base, time.time()),
            )

    def tasks(self, *, key: str | None = None) -> list[TaskRow]:
        """Every task, in the order of the tasks file (only ``key``'s, when given)."""
        rows = self._db.execute(
            "SELECT key, seq, spec, repo, base, state, attempt, attempt_id, node, status,"
            " commit_id, branch, tokens, reserved, lost_charge, lost, error, cost_usd FROM tasks"
            " WHERE ?1 IS NULL OR key = ?1 ORDER BY seq",
            (key,),
        ).fetchall()
        return [
            TaskRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9],
                    r[10], r[11], r[12], r[13], r[14], tuple(json.loads(r[15])), r[16], r[17])
            for r in rows
        ]  # fmt: skip

    def task(self, key: str) -> TaskRow:
        """One task; TaskError when the batch has no such key."""
        for row in self.tasks(key=key):
            return row
        raise TaskError("no such task in the batch", task_id=key)

    def committed(self) -> int:
        """Tokens the batch has spent or holds: used by finished tasks, reserved by placed
        ones, and the whole reservation of every attempt lost with its node."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(CASE WHEN state='placed' THEN reserved ELSE tokens END),0)"
            " + COALESCE(SUM(lost_charge),0) FROM tasks"
        ).fetchone()
        return int(row[0])

    def place(self, key: str, attempt_id: str, reserve: int, budget: int | None) -> bool:
        """Reserve ``reserve`` tokens and mark the task placed as ``attempt_id``; False (and
        nothing changed) when the batch budget cannot cover it now."""
        with self._tx() as db:
            if budget is not None:
                row = db.execute(
                    "SELECT COALESCE(SUM(CASE WHEN state='placed' THEN reserved ELSE tokens END),0)"
                    " + COALESCE(SUM(lost_charge),0) FROM tasks"
                ).fetchone()
                if int(row[0]) + reserve > budget:
                    return False
            db.execute(
                "UPDATE tasks SET state='placed', attempt_id=?, reserved=?, updated_at=?"
                " WHERE key=?",
                (attempt_id, reserve, time.time(), key),
            )
            return True

    def update(self, key: str, **fields: Any) -> None:
        """Set columns of one task (names are ours, never a caller's)."""
        cols = {"commit": "commit_id"}
        sets = ", ".join(f"{cols.get(k, k)}=?" for k in fields)
        vals = [json.dumps(list(v)) if k == "lost" else v for k, v in fields.items()]
        with self._tx() as db:
            db.execute(
                f"UPDATE tasks SET {sets}, updated_at=? WHERE key=?",  # noqa: S608 (our names)
                (*vals, time.time(), key),
            )

    def lose(self, key: str, reason: str) -> TaskRow:
        """The placed attempt died with its node: charge its reservation, queue a new one."""
        row = self.task(key)
        lost = (*row.lost, f"{row.attempt_id}@{row.node or '?'}: {reason}"[:500])
        with self._tx() as db:
            db.execute(
                "UPDATE tasks SET state='queued', attempt=attempt+1, lost_charge=lost_charge+?,"
                " reserved=0, node='', lost=?, updated_at=? WHERE key=?",
                (row.reserved, json.dumps(list(lost)), time.time(), key),
            )
        return self.task(key)


def usd_or_none(value: object) -> float | None:
    """A node's reported cost in dollars, if it is a plausible number (the node is untrusted)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9:
        return float(value)
    return None
