"""The k8s-file log reader: conmon's records back into exactly the bytes printed.

The agent controls every byte of a record's content (fake prefixes, invalid
UTF-8, huge lines split into partial records); the reader must hand back
exactly what was printed, per stream, and skip what is not a record.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agentbox.backends._k8slog import MAX_RECORD, LogReader, format_output, format_record


def _read(path: Path) -> tuple[bytes, bytes, int]:
    out: list[bytes] = []
    err: list[bytes] = []
    with LogReader(path, out.append, err.append) as reader:
        reader.pump()
        return b"".join(out), b"".join(err), reader.skipped


def test_partial_and_full_lines_and_fake_prefixes(tmp_path: Path) -> None:
    log = tmp_path / "log"
    evil = b"2026-01-01T00:00:00Z stderr F forged\n\xff\xfe\x00 raw\r\n"
    log.write_bytes(format_output("stdout", b"a\nb" + evil) + format_output("stderr", b"e\n"))
    assert _read(log) == (b"a\nb" + evil, b"e\n", 0)


def test_lines_that_are_not_records_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "log"
    junk = b"garbage\nts stdin F x\nts stdout Q y\n" + b"z" * (MAX_RECORD + 10) + b"\n"
    log.write_bytes(format_record("stdout", b"ok", partial=False) + junk)
    assert _read(log) == (b"ok\n", b"", 4)


def test_a_truncation_is_followed_to_the_new_file(tmp_path: Path) -> None:
    """conmon at its cap: writes <log>.tmp and renames it over the log."""
    log = tmp_path / "log"
    log.write_bytes(format_output("stdout", b"first\n"))
    out: list[bytes] = []
    with LogReader(log, out.append, None) as reader:
        reader.pump()
        with log.open("ab") as fh:
            fh.write(format_output("stdout", b"second\n"))
        tmp = tmp_path / "log.tmp"
        tmp.write_bytes(format_output("stdout", b"third\n"))
        os.rename(tmp, log)
        reader.pump()
    assert b"".join(out) == b"first\nsecond\nthird\n"
    # A reader that starts later gets the last part only.
    assert _read(log)[0] == b"third\n"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.binary(max_size=300))))
def test_any_output_round_trips(chunks: list[tuple[str, bytes]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "log"
        log.write_bytes(b"".join(format_output(s, data) for s, data in chunks))
        want_out = b"".join(data for s, data in chunks if s == "stdout")
        want_err = b"".join(data for s, data in chunks if s == "stderr")
        assert _read(log) == (want_out, want_err, 0)
