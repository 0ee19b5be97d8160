"""The models file parser on hostile files: a clear ConfigError naming the file, never a traceback.

Issue 18 item 4: non-UTF-8 bytes, 200,000-deep nesting and huge files crashed
(``RecursionError``) or were read whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.errors import ConfigError
from agentbox.gateway.registry import MAX_REGISTRY_BYTES, load_registry

GOOD = '[models.a]\nkind = "replay"\nupstream = "s.yaml"\n'


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_registry(path=path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_good_file_loads(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    (tmp_path / "s.yaml").write_text("turns: []\n")  # checked at load (issue 13.4)
    f.write_text(GOOD)
    assert load_registry(path=f).get("a").upstream == str(tmp_path / "s.yaml")


def test_non_utf8_bytes(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_bytes(GOOD.encode() + b'description = "\xff\xfe"\n')
    _refused(f, "not UTF-8")


@pytest.mark.parametrize(
    "value",
    ["[" * 200_000 + "]" * 200_000, "{a=" * 200_000 + "1" + "}" * 200_000],
    ids=["arrays", "inline-tables"],
)
def test_200k_deep_nesting(tmp_path: Path, value: str) -> None:
    f = tmp_path / "models.toml"
    f.write_text(GOOD + f"description = {value}\n")
    assert f.stat().st_size <= MAX_REGISTRY_BYTES
    _refused(f, "nested too deeply")


def test_huge_file_refused_by_size(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text(GOOD + "# padding\n" * (MAX_REGISTRY_BYTES // 10 + 1))
    _refused(f, "larger than")


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "models.toml"
    os.mkfifo(fifo)  # would block a plain read forever
    _refused(fifo, "not a regular file")
    _refused(tmp_path, "not a regular file")
    _refused(tmp_path / "missing.toml", "No such file")


def test_bad_toml_and_bad_entries_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text("[models.a\n")
    _refused(f)
    f.write_text('[models.a]\nkind = "nope"\nupstream = "x"\n')
    _refused(f, "[models.a]")
