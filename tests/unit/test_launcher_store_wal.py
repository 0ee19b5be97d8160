"""The task store keeps its SQLite write-ahead log between operations.

Each operation opens its own short-lived connection. Whenever the last connection to
a WAL database closes, SQLite checkpoints the log into the db and deletes it, syncing
the db, the log and the dir; the store holds one connection open for its life so
that no operation's connection is that last one (about 40 fewer syncs per task).
"""

from __future__ import annotations

import time
from pathlib import Path

from agentbox.launcher._store import Store


def test_the_wal_outlives_each_operation_and_goes_with_the_store(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    wal = tmp_path / "state.db-wal"
    store = Store(db)
    store.insert(id="t-wal", status="queued", repo="/r", task="t", model="m", budget=1,
                 deadline=60.0, created_at=time.time())  # fmt: skip
    assert store.update("t-wal", phase="one")
    assert wal.exists(), "the log was checkpointed and deleted after an operation"
    assert store.get("t-wal").phase == "one"
    store.close()
    store.close()  # idempotent
    # Positive control: with no connection held, the last one to close removes the log.
    assert not wal.exists()
    assert store.update("t-wal", phase="two")  # still usable after close
    assert Store(db).get("t-wal").phase == "two"
