"""A detached sandbox's output log: conmon's ``k8s-file`` format, read defensively.

conmon writes every chunk the sandbox prints as one record per line::

    2026-12-01T14:40:29.988697779+00:00 stdout F line 2834 xxxx
    2026-12-01T14:40:30.013204109+00:00 stderr P partial-no-nl

timestamp, stream (``stdout``/``stderr``), a tag (``F``: the chunk ended with a
newline, which conmon strips; ``P``: a partial line, no newline), one space, then
the raw bytes. conmon splits the sandbox's output at newlines and at its 8 KiB
read buffer, so content never holds a newline and a 10 MB line is many ``P``
records. The agent controls every byte of the content, never the prefix: a line
printed as ``... stderr F fake`` lands in a ``stdout`` record whose content
happens to look like a prefix, and is delivered as stdout. Content may be any
bytes (invalid UTF-8 too): nothing here decodes it.

The cap (``--log-opt max-size``, :data:`~agentbox.backends.base.MAX_LOG_BYTES`):
before a record would take the file past it, conmon opens ``<log>.tmp``,
truncated, and renames it over the log. The file then holds the *last* part of
the output, never more than the cap. A :class:`LogReader` that keeps up sees the
rename (the path names another inode), drains the old file to its end and goes
on with the new one, so it loses nothing; a reader started later (a re-adopting
launcher) gets only what the current file holds.

A line that is not a record (no conmon wrote it: a corrupt or foreign file) is
skipped and counted, and so is one longer than :data:`MAX_RECORD` (conmon's are
at most 8 KiB of content): the reader resynchronises at the next newline.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path

from agentbox.backends.base import Exited, OutputCallback

#: A record longer than this is not conmon's (its content is at most 8 KiB): skipped.
MAX_RECORD = 256 * 1024
_READ = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def format_record(stream: str, data: bytes, *, partial: bool) -> bytes:
    """One record as conmon writes it (the fake backend writes its logs with this)."""
    ts = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000+00:00")
    return b"%s %s %s %s\n" % (ts.encode(), stream.encode(), b"P" if partial else b"F", data)


def format_output(stream: str, data: bytes) -> bytes:
    """``data`` as conmon logs it: one record per line, a last partial line as ``P``."""
    lines = data.split(b"\n")
    out = [format_record(stream, line, partial=False) for line in lines[:-1]]
    if lines[-1]:
        out.append(format_record(stream, lines[-1], partial=True))
    return b"".join(out)


def exit_marker(log: Path) -> Path:
    """Where a follower records how the sandbox logging to ``log`` ended, before it
    removes the sandbox: a follower that comes after (the first died between the
    removal and its return) replays the log and returns the same :class:`Exited`."""
    return log.with_name(log.name + ".exit")


def write_exit(log: Path, exited: Exited) -> None:
    """Record the end atomically (a temp file renamed over the marker)."""
    marker = exit_marker(log)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"exit_code": exited.exit_code, "timed_out": exited.timed_out}))
    tmp.replace(marker)


def read_exit(log: Path) -> Exited | None:
    """How the sandbox ended, from the marker; None when there is none (or it is unreadable)."""
    try:
        rec = json.loads(exit_marker(log).read_text())
        return Exited(int(rec["exit_code"]), bool(rec["timed_out"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class LogReader:
    """Reads a k8s-file log from its start, across conmon's truncations, into callbacks.

    Call :meth:`pump` whenever new output may be there; it returns whether it
    delivered anything. :meth:`close` releases the file. ``skipped`` counts the
    lines that were not records.
    """

    def __init__(
        self, path: Path, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
    ) -> None:
        self.path = path
        self._out = on_stdout
        self._err = on_stderr
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._buf = bytearray()
        self._resync = False  # inside an over-long line: drop up to the next newline
        self.skipped = 0
        self.delivered = 0

    def pump(self) -> bool:
        """Deliver every complete record written so far; follow a truncation."""
        got = False
        for _ in range(64):  # each pass drains one file; a rename starts another
            if self._fd is None and not self._open():
                return got
            got |= self._drain()
            if not self._rotated():
                return got
            self._switch()
        return got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, _OPEN_FLAGS)
        except FileNotFoundError:
            return False  # conmon has not made it yet
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError(f"the sandbox log {self.path} is not a regular file")
        self._fd, self._ino = fd, (st.st_dev, st.st_ino)
        return True

    def _rotated(self) -> bool:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return False  # between conmon's open of .tmp and its rename: look again later
        return (st.st_dev, st.st_ino) != self._ino

    def _switch(self) -> None:
        self.close()
        if self._buf:  # conmon renames only between whole records: this one is torn
            self.skipped += 1
            self._buf.clear()
        self._resync = False

    def _drain(self) -> bool:
        assert self._fd is not None
        got = False
        while True:
            chunk = os.read(self._fd, _READ)
            if not chunk:
                return got
            got |= self._feed(chunk)

    def _feed(self, chunk: bytes) -> bool:
        got = False
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if self._resync:
                    return got
                if len(self._buf) + len(rest) > MAX_RECORD:
                    self.skipped += 1
                    self._buf.clear()
                    self._resync = True
                else:
                    self._buf += rest
                return got
            piece = chunk[start:nl]
            start = nl + 1
            if self._resync:
                self._resync = False
                continue
            if self._buf:
                piece = bytes(self._buf) + piece
                self._buf.clear()
            if len(piece) > MAX_RECORD:
                self.skipped += 1
                continue
            got |= self._record(piece)

    def _record(self, line: bytes) -> bool:
        parts = line.split(b" ", 3)
        if len(parts) < 3 or not parts[0]:
            self.skipped += 1
            return False
        stream, tag = parts[1], parts[2].split(b":", 1)[0]
        data = parts[3] if len(parts) == 4 else b""
        if tag == b"F":
            data += b"\n"
        elif tag != b"P":
            self.skipped += 1
            return False
        if stream == b"stdout":
            sink = self._out
        elif stream == b"stderr":
            sink = self._err
        else:
            self.skipped += 1
            return False
        if data:
            self.delivered += len(data)
            if sink is not None:
                sink(data)
        return True
