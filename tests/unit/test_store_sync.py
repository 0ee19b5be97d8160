"""The task store syncs every state change to disk and leaves progress notes to the next sync.

A ``phase`` note is rewritten at every step of every task; syncing each one cost more
than the rest of the update (about 4 ms on this host). Counted with strace: the syncs
SQLite asks the kernel for, notes against state changes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

_SCRIPT = """
import sys
from pathlib import Path
from agentbox.launcher._store import Store
s = Store(Path(sys.argv[1]))
s.insert(id="t-1", status="queued", repo="/r", task="t", model="m", budget=1, deadline=1.0,
         created_at=1.0)
print("go", flush=True)
for i in range(20):
    if sys.argv[2] == "notes":
        s.update("t-1", phase=f"step {i}")
    else:
        s.update("t-1", phase=f"step {i}", exit_code=i)
print("end", flush=True)
"""


def _syncs(tmp_path: Path, kind: str) -> int:
    """fsync/fdatasync calls made by 20 updates of ``kind`` (not the set-up, not the exit's
    checkpoint)."""
    out = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,write", "-e", "signal=none",
         sys.executable, "-c", _SCRIPT, str(tmp_path / f"{kind}.db"), kind],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    trace = out.stderr.splitlines()
    start = next(i for i, line in enumerate(trace) if 'write(1, "go' in line)
    end = next(i for i, line in enumerate(trace) if 'write(1, "end' in line)
    return sum(1 for line in trace[start:end] if "sync(" in line)


def test_notes_are_not_synced_and_state_changes_are(tmp_path: Path) -> None:
    assert _syncs(tmp_path, "state") >= 20  # each state change synced before it returns
    assert _syncs(tmp_path, "notes") == 0
