"""A hostile or broken Boxfile gives a clear BoxfileError naming the file, never a traceback.

Issue 18 item 4: non-UTF-8 bytes, nesting 200,000 deep and a huge file used to
escape as ``UnicodeDecodeError``/``RecursionError`` (or be read whole).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.boxfile import MAX_BOXFILE_BYTES, load_boxfile, parse_size
from agentbox.errors import BoxfileError


def _write(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "Boxfile"
    p.write_bytes(data)
    return p


def _refused(path: Path) -> str:
    with pytest.raises(BoxfileError) as info:
        load_boxfile(path)
    msg = str(info.value)
    assert str(path) in msg  # the file is named
    assert info.value.path == path
    return msg


def test_non_utf8_bytes(tmp_path: Path) -> None:
    msg = _refused(_write(tmp_path, b'image = "x"\n# caf\xe9 \xff\xfe\n'))
    assert "UTF-8" in msg and "byte" in msg


@pytest.mark.parametrize(
    "data",
    [
        b"a = " + b"[" * 200_000 + b"]" * 200_000 + b"\n",
        b"a = " + b"{b=" * 200_000 + b"1" + b"}" * 200_000 + b"\n",
    ],
    ids=["arrays", "inline-tables"],
)
def test_deep_nesting(tmp_path: Path, data: bytes) -> None:
    msg = _refused(_write(tmp_path, data))
    assert "nest" in msg


def test_nesting_just_under_the_interpreter_limit_is_a_plain_error(tmp_path: Path) -> None:
    # Deep enough to trouble the validators, shallow enough for the TOML parser.
    data = b"[resources]\ncpus = " + b"[" * 300 + b"]" * 300 + b"\n"
    msg = _refused(_write(tmp_path, data))
    assert "resources.cpus" in msg or "nest" in msg


def test_huge_file_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    p = tmp_path / "Boxfile"
    with p.open("wb") as fh:  # sparse: 4 GiB that take no disk
        fh.truncate(4 * 1024**3)
    msg = _refused(p)
    assert str(MAX_BOXFILE_BYTES) in msg or "too large" in msg


def test_just_over_the_cap(tmp_path: Path) -> None:
    data = b'image = "localhost/x"\n' + b"#" * MAX_BOXFILE_BYTES + b"\n"
    assert "too large" in _refused(_write(tmp_path, data))


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "Boxfile"
    os.mkfifo(fifo)  # reading it would block forever
    assert "regular file" in _refused(fifo)
    assert "regular file" in _refused(Path("/dev/zero"))


def test_directory(tmp_path: Path) -> None:
    assert "regular file" in _refused(tmp_path)


@pytest.mark.parametrize("value", ["9" * 400 + "TiB", "1" + "0" * 5000, "1" * 400])
def test_absurd_sizes_are_value_errors(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError):
        parse_size(value)
    msg = _refused(_write(tmp_path, f'[resources]\nmemory = "{value}"\n'.encode()))
    assert "resources.memory" in msg


def test_absurd_integer(tmp_path: Path) -> None:
    msg = _refused(_write(tmp_path, b"[resources]\nmemory = " + b"9" * 5000 + b"\n"))
    assert "resources.memory" in msg or "integer" in msg
