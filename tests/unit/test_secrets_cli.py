"""``agentbox secret set``'s value: from stdin, a variable or a file; checked, never quoted."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from agentbox.cli._secret import read_value
from agentbox.errors import InvalidValue


class _Pipe(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", _Pipe(io.BytesIO(data)))


def test_stdin_drops_one_line_end(monkeypatch: pytest.MonkeyPatch) -> None:
    _stdin(monkeypatch, b"tok-1\n")
    assert read_value("X", None, None) == "tok-1"
    _stdin(monkeypatch, b"tok-2\r\n")
    assert read_value("X", None, None) == "tok-2"
    _stdin(monkeypatch, b"two\nlines\n")
    with pytest.raises(InvalidValue) as err:
        read_value("X", None, None)
    assert "two" not in str(err.value)
    _stdin(monkeypatch, b"\xff\xfe")
    with pytest.raises(InvalidValue, match="UTF-8"):
        read_value("X", None, None)


def test_from_env_and_from_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MY_TOKEN_VAR", "from-env")
    assert read_value("X", "MY_TOKEN_VAR", None) == "from-env"
    monkeypatch.delenv("MY_TOKEN_VAR")
    with pytest.raises(InvalidValue, match="MY_TOKEN_VAR"):
        read_value("X", "MY_TOKEN_VAR", None)
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert read_value("X", None, f) == "from-file"
    with pytest.raises(InvalidValue, match="one of"):
        read_value("X", "A", f)
    with pytest.raises(InvalidValue, match="No such file"):
        read_value("X", None, tmp_path / "missing")
    f.write_text("x" * 9000)
    with pytest.raises(InvalidValue, match="longer than 8192"):
        read_value("X", None, f)
