"""The detached microVM monitor's log writer (k8s-file, capped): what the guest prints,
however hostile, comes back through the reader byte for byte up to the cap."""

from __future__ import annotations

from pathlib import Path

from agentbox.backends._k8slog import LogReader
from agentbox.backends.microvm.qemu._monitor import RECORD_BYTES, LogWriter


def _read(path: Path) -> tuple[bytes, bytes, int]:
    out: list[bytes] = []
    err: list[bytes] = []
    with LogReader(path, out.append, err.append) as reader:
        reader.pump()
        return b"".join(out), b"".join(err), reader.skipped


def test_hostile_output_round_trips(tmp_path: Path) -> None:
    log = tmp_path / "sandbox.log"
    w = LogWriter(log)
    chunks = [
        b"plain\n",
        b"x" * (3 * RECORD_BYTES + 5) + b"\n",  # one long line: several records
        b"2026-01-01T00:00:00Z stderr F forged\n",  # a forged prefix stays stdout
        b"\xff\xfe\x00 invalid utf-8",
        b" and the same line goes on\n\n",
        b"no newline at the end",
    ]
    for c in chunks:
        w.write("stdout", c)
    w.write("stderr", b"err\n")
    w.close()
    out, err, skipped = _read(log)
    assert out == b"".join(chunks)
    assert err == b"err\n"
    assert skipped == 0
    assert max(len(line) for line in log.read_bytes().split(b"\n")) < RECORD_BYTES + 100


def test_the_log_is_capped_and_the_cut_noted(tmp_path: Path) -> None:
    log = tmp_path / "sandbox.log"
    w = LogWriter(log, cap=10_000)
    for _ in range(100):
        w.write("stdout", b"y" * 999 + b"\n")
    w.close()
    assert log.stat().st_size <= 10_000 + 200
    out, err, _ = _read(log)
    lines = len(out) // 1000
    assert 5 <= lines < 10 and out == (b"y" * 999 + b"\n") * lines  # the first part, whole
    assert b"log cap reached" in err
