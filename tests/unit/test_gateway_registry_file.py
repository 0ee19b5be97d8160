"""The models file parser on hostile files: a clear ConfigError naming the file, never a traceback.

Issue 18 item 4: non-UTF-8 bytes, 200,000-deep nesting and huge files crashed
(``RecursionError``) or were read whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.errors import ConfigError
from agentbox.gateway.registry import MAX_REGISTRY_BYTES, ModelEntry, _parse, load_registry

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


_ENTRY = {"kind": "anthropic", "upstream": "https://x"}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({}, "kind: is required; [models.x] upstream: is required"),
        ({"kind": 5, "upstream": "https://x"},
         "kind: must be one of 'anthropic', 'compatible' or 'replay', not 5"),
        ({**_ENTRY, "surprise": 1, "kind": "bad"},
         "kind: must be one of 'anthropic', 'compatible' or 'replay', not 'bad'; "
         "[models.x] surprise: is not a key a model entry has (check its spelling)"),
        ({**_ENTRY, "key_env": 5}, "key_env: must be a string, not 5"),
        ({**_ENTRY, "unsupported_fields": "abc"}, "unsupported_fields: must be a tuple, not 'abc'"),
        ({**_ENTRY, "unsupported_fields": [1, "a", 2]},
         "unsupported_fields.0: must be a string, not 1; "
         "[models.x] unsupported_fields.2: must be a string, not 2"),
        ({**_ENTRY, "forward_beta": "maybe"}, "forward_beta: must be a bool, not 'maybe'"),
        ({**_ENTRY, "image_tokens": -1},
         "image_tokens: Input should be greater than or equal to 0"),
        ({**_ENTRY, "image_tokens": 1.5}, "image_tokens: Input should be a valid integer, got a "
         "number with a fractional part"),
        ({**_ENTRY, "document_tokens": {}}, "document_tokens: must be a int, not {}"),
        ({**_ENTRY, "cache_read_weight": "x"}, "cache_read_weight: must be a float, not 'x'"),
        ({**_ENTRY, "cache_read_weight": float("nan")},
         "cache_read_weight: Input should be greater than or equal to 0"),
        ({**_ENTRY, "allowed_fields": ["mcp_servers", "container"]},
         "allowed_fields: container, mcp_servers: would let the upstream reach the network"),
        ({**_ENTRY, "allowed_betas": [3]}, "allowed_betas.0: must be a string, not 3"),
    ],
)  # fmt: skip
def test_entry_errors_name_each_key(fields: dict[str, object], said: str) -> None:
    """Hand-checked entries (the gateway loads no pydantic) say what pydantic's did."""
    with pytest.raises(ConfigError) as info:
        _parse({"models": {"x": fields}}, base=None, source="S")
    assert str(info.value) == f"model registry S: [models.x] {said}"


def test_entry_values_are_converted_as_before() -> None:
    entry = _parse(
        {"models": {"x": {**_ENTRY, "unsupported_fields": ["a"], "forward_beta": "yes",
                          "image_tokens": 2.0, "cache_read_weight": 1}}},
        base=None, source="S",
    ).get("x")  # fmt: skip
    assert entry.unsupported_fields == ("a",) and entry.forward_beta is True
    assert entry.image_tokens == 2 and isinstance(entry.image_tokens, int)
    assert entry.cache_read_weight == 1.0 and isinstance(entry.cache_read_weight, float)
    with pytest.raises(ValueError, match="name: bad model name 'a b'"):
        ModelEntry(name="a b", kind="replay", upstream="s")
