"""The request ledger: one line per model request the gateway forwarded, beside usage.json.

``usage.json`` holds a task's running totals; ``requests.jsonl``, in the same
directory (the confined gateway's state directory, ``usage.json.d/``), holds what
each ``/v1/messages`` request cost, as the gateway metered it: the upstream's
message id (from ``message_start``, or the body's ``id``), the model, the four
token counts it charged, the HTTP status, the ``stop_reason``, and whether the
counts are final (``complete``) or the worst case charged for a broken stream.
The transcript joins an agent turn (its assistant message id) to its record,
so per-turn tokens come from the gateway's metering, never from the model's text.

The gateway appends; nobody in the sandbox can write here. The file is capped
(:data:`MAX_RECORDS` lines, :data:`MAX_BYTES`): later requests are still
metered in ``usage.json``, only their lines are not written. The reader is
defensive all the same (the file may be cut mid-line by a crash or the cap):
a line that is not a well-formed record is skipped, never raised on.

Standard library only at import: the package ``agentbox.gateway`` imports this, before
``python -m agentbox.gateway`` blocks ``rich``, so the logger is imported where it is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The ledger's file name, in the directory of the usage file the gateway writes.
LEDGER_NAME = "requests.jsonl"
#: The most records written (a long task makes a few hundred requests).
MAX_RECORDS = 20_000
#: The most bytes written (a record is ~250 bytes).
MAX_BYTES = 8 << 20
_MAX_ID = 200
_COUNTS = ("input", "output", "cache_creation", "cache_read")


@dataclass(frozen=True)
class RequestRecord:
    """One forwarded model request, as the gateway metered it."""

    time: float
    message_id: str | None
    """The upstream's message id (``msg_…``): Claude Code's assistant ``message.id``."""
    model: str
    input: int
    output: int
    cache_creation: int
    cache_read: int
    status: int
    """The upstream's HTTP status."""
    stop_reason: str | None
    complete: bool
    """The counts are the upstream's final ones (else the worst case charged)."""
    asked: str | None = None
    """The ``model`` the client asked for, before the gateway rewrote it."""
    cost_usd: float | None = None
    """Dollars charged at the entry's prices; None: the price is unknown."""
    cache_creation_1h: int = 0
    started: float | None = None
    """When the request arrived (``time`` is when it was settled); None if unknown."""


#: ``json.dumps(…, separators=…)`` builds an encoder per call (~3 µs of the ~8 a record
#: costs): one, made once, writes the same bytes.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _short(v: object) -> str | None:
    """A printable, bounded string from the upstream, else None."""
    if not isinstance(v, str) or not v or len(v) > _MAX_ID or not v.isprintable():
        return None
    return v


def _log() -> Any:
    from agentbox.core.log import get_logger

    return get_logger(__name__)


class RequestLog:
    """The gateway's writer: appends one JSON line per request, until the cap."""

    def __init__(self, dir_fd: int | None, directory: Path) -> None:
        # Opened now (before a privilege drop), appended to through the descriptor.
        # Emptied, as usage.json starts again from zero: the two always agree.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        if dir_fd is not None:
            self._fd = os.open(LEDGER_NAME, flags, 0o644, dir_fd=dir_fd)
        else:
            self._fd = os.open(directory / LEDGER_NAME, flags, 0o644)
        os.fchmod(self._fd, 0o644)
        self._bytes = 0
        self._records = 0
        self._full_logged = False

    def append(
        self,
        *,
        message_id: object,
        model: object,
        counts: Any,
        status: int,
        stop_reason: object,
        complete: bool,
        asked: object = None,
        cost_usd: float | None = None,
        started: float | None = None,
    ) -> None:
        """Write one record (``counts``: a :class:`~._meter.TokenCount`, as charged)."""
        if self._fd < 0:
            return
        rec = {
            "time": round(time.time(), 3),
            "message_id": _short(message_id),
            "model": _short(model) or "",
            "input": counts.input or 0,
            "output": counts.output or 0,
            "cache_creation": counts.cache_creation,
            "cache_read": counts.cache_read,
            "status": status,
            "stop_reason": _short(stop_reason),
            "complete": complete,
            "asked": _short(asked),
            "cost_usd": None if cost_usd is None else round(cost_usd, 9),
            "cache_creation_1h": counts.cache_creation_1h,
        }
        if started is not None:
            rec["started"] = round(started, 3)
        line = (_COMPACT.encode(rec) + "\n").encode()
        if self._records >= MAX_RECORDS or self._bytes + len(line) > MAX_BYTES:
            if not self._full_logged:
                self._full_logged = True
                _log().warning("request ledger full: later requests only in usage.json")
            return
        try:
            os.write(self._fd, line)
        except OSError as exc:
            _log().error("cannot write request ledger", error=str(exc))
            return
        self._records += 1
        self._bytes += len(line)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 else None


def _record(raw: bytes) -> RequestRecord | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    counts = [_int(doc.get(k)) for k in _COUNTS]
    status = _int(doc.get("status"))
    t = doc.get("time")
    if None in counts or status is None or not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    mid, stop = doc.get("message_id"), doc.get("stop_reason")
    return RequestRecord(
        time=float(t),
        message_id=_short(mid),
        model=_short(doc.get("model")) or "",
        input=counts[0] or 0,
        output=counts[1] or 0,
        cache_creation=counts[2] or 0,
        cache_read=counts[3] or 0,
        status=status,
        stop_reason=_short(stop),
        complete=doc.get("complete") is True,
        asked=_short(doc.get("asked")),
        cost_usd=_usd(doc.get("cost_usd")),
        cache_creation_1h=_int(doc.get("cache_creation_1h")) or 0,
        started=_started(doc.get("started"), float(t)),
    )


def _started(v: object, end: float) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= end:
        return float(v)
    return None


def _usd(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e12:
        return float(v)
    return None


def ledger_path(usage_file: Path) -> Path:
    """Where the ledger of the gateway whose usage file is ``usage_file`` lives.

    A confined gateway's ``usage.json`` is a link into its state directory
    (``usage.json.d/usage.json``, made by the launcher): its ledger is there too.
    """
    if usage_file.is_symlink():
        target = usage_file.readlink()
        parts = target.parts
        if not target.is_absolute() and len(parts) == 2 and ".." not in parts:
            return usage_file.parent / parts[0] / LEDGER_NAME
    return usage_file.parent / LEDGER_NAME


def read_requests(usage_file: Path) -> list[RequestRecord]:
    """The records of the ledger beside ``usage_file``; [] if there is none.

    Never raises on the content: a line that is not a whole, well-formed record
    (a cut last line, a corrupt one) is skipped. Reads at most :data:`MAX_BYTES`.
    """
    path = ledger_path(usage_file)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return []
            data = fh.read(MAX_BYTES)
        except OSError:
            return []
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        lines = lines[:-1]  # cut mid-line (a crash, a partial write): not a record
    out: list[RequestRecord] = []
    for raw in lines[:MAX_RECORDS]:
        if raw.strip():
            rec = _record(raw)
            if rec is not None:
                out.append(rec)
    return out
