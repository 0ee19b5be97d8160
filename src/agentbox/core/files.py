"""One way to read a small file that something else may have planted: no link followed, no
FIFO or device opened for real (non-blocking, regular files only), at most ``limit`` bytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path`` if it is a regular file (not through a link);
    None otherwise or on any error."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            return fh.read(limit)
        except OSError:
            return None
