"""The task store syncs every state change to disk, once, and leaves progress notes to
the next sync.

A ``phase`` note is rewritten at every step of every task; syncing each one cost more
than the rest of the update (about 4 ms on this host). Counted with strace: the syncs
SQLite asks the kernel for, notes against state changes.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

_STRACE = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

_SCRIPT = """
import sys
from pathlib import Path
from agentbox.launcher._store import Store
for kind in ("notes", "state"):
    s = Store(Path(sys.argv[1]) / f"{kind}.db")
    s.insert(id="t-1", status="queued", repo="/r", task="t", model="m", budget=1,
             deadline=1.0, created_at=1.0)
    print(f"go {kind}", flush=True)
    for i in range(20):
        if kind == "notes":
            s.update("t-1", phase=f"step {i}")
        else:
            s.update("t-1", phase=f"step {i}", exit_code=i)
    print(f"end {kind}", flush=True)
"""


def _syncs(tmp_path: Path) -> dict[str, int]:
    """fsync/fdatasync calls made by 20 updates of each kind (not the set-up, not the
    exit's checkpoint), in one traced interpreter."""
    out = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,write", "-e", "signal=none",
         sys.executable, "-c", _SCRIPT, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    trace = out.stderr.splitlines()
    counts = {}
    for kind in ("notes", "state"):
        start = next(i for i, line in enumerate(trace) if f'write(1, "go {kind}' in line)
        end = next(i for i, line in enumerate(trace) if f'write(1, "end {kind}' in line)
        counts[kind] = sum(1 for line in trace[start:end] if "sync(" in line)
    return counts


@_STRACE
def test_notes_are_not_synced_and_state_changes_are(tmp_path: Path) -> None:
    syncs = _syncs(tmp_path)
    assert syncs["notes"] == 0
    # Each state change synced before it returns, once: the log, not the directory too
    # (a connection opened per operation made SQLite sync the dir at its first commit).
    assert syncs["state"] == 20


def _open_db_fds(db: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(db))


def test_a_threads_connection_goes_with_the_thread(tmp_path: Path) -> None:
    """A launcher runs a thread per task's monitor: each thread's connection must close
    when the thread ends, or a long-lived launcher runs out of descriptors."""
    from agentbox.launcher._store import Store

    db = tmp_path / "state.db"
    store = Store(db)
    store.insert(id="t-1", status="queued", repo="/r", task="t", model="m", budget=1,
                 deadline=1.0, created_at=1.0)  # fmt: skip

    def threads(n: int, on: Store) -> int:
        for _ in range(n):
            t = threading.Thread(target=on.get, args=("t-1",))
            t.start()
            t.join()
        gc.collect()
        return _open_db_fds(db)

    # SQLite may keep one closed connection's descriptor for reuse (a lock on the
    # inode is held by another): one, however many threads came and went.
    after_one = threads(1, store)
    assert threads(20, store) == after_one
    store.close()
    del store
    gc.collect()
    assert _open_db_fds(db) == 0  # the store's own connections went with it
