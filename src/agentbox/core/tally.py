"""Counters that outlive processes: one byte appended per event, the file's size the count.

``O_APPEND`` makes each append atomic among processes, so a launcher, a one-shot
``agentbox run`` and the pool keeper can count into one file with no lock, and a count
survives every restart. Used for launcher starts and warm-pool claims (the metrics read
them: ``agentbox.launcher.metrics``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: Under ``<data_dir>/run``: one byte per launcher start.
LAUNCHER_STARTS = "launcher-starts.tally"
#: Under ``<data_dir>/pool``: one byte per task served from the warm pool.
POOL_CLAIMS = "claims.tally"


def count_one(path: Path) -> None:
    """Add one to the tally at ``path`` (created 0600); never raises."""
    with contextlib.suppress(OSError):
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)


def tally(path: Path) -> int:
    """The count at ``path``; 0 if there is none."""
    try:
        return path.lstat().st_size
    except OSError:
        return 0
