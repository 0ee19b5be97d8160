"""A size cap on the gateway's log.

The gateway's stdout and stderr go to the task's ``gateway.log``; what lands
there is partly chosen by the sandbox (45,000 bad requests wrote 1.9 MB in 20 s
before the per-connection warnings were rate-limited). When stderr is a regular
file, :func:`cap_log` replaces ``sys.stdout`` and ``sys.stderr`` with one writer
that stops at :data:`DEFAULT_LOG_CAP` bytes (``AGENTBOX_GATEWAY_LOG_CAP``
overrides it), after writing a line that says so. ``RLIMIT_FSIZE`` (set by
:func:`log_file_limit`'s figure) backs it for writes that bypass Python.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import sys

#: gateway.log stops growing here (the truncation note comes on top).
DEFAULT_LOG_CAP = 8 << 20
_ENV = "AGENTBOX_GATEWAY_LOG_CAP"


def _cap() -> int:
    raw = os.environ.get(_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_LOG_CAP


def _stderr_is_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(2).st_mode)
    except OSError:
        return False


def log_file_limit() -> int | None:
    """``RLIMIT_FSIZE`` for the gateway: the log cap plus room for the note, when logging
    to a file (None otherwise: a terminal is not filled up)."""
    return _cap() + (1 << 20) if _stderr_is_file() else None


class CappedLog(io.TextIOBase):
    """A text stream writing to ``fd`` until ``limit`` bytes, then one note, then nothing."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__()
        self._fd = fd
        self.limit = limit
        self.used = os.fstat(fd).st_size

    def write(self, s: str) -> int:
        if self.used >= self.limit:
            return len(s)
        data = s.encode("utf-8", "replace")
        if self.used + len(data) > self.limit:
            data = (
                f"\n[agentbox: gateway log capped at {self.limit} bytes; later lines dropped]\n"
            ).encode()
            self.used = self.limit
        else:
            self.used += len(data)
        with contextlib.suppress(OSError):
            os.write(self._fd, data)
        return len(s)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        pass


def cap_log() -> None:
    """Cap what this process writes to stdout/stderr if they go to a regular file."""
    if _stderr_is_file():
        capped = CappedLog(2, _cap())
        sys.stdout = capped
        sys.stderr = capped
