"""The front end's framing without json on the client's side: the same documents as
json's, and a client start that imports none of the heavy modules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentbox.front._wire import WireError, _decode, encode

_SCALARS = st.none() | st.booleans() | st.integers() | st.text()
_DOCS = st.dictionaries(
    st.text(),
    st.recursive(_SCALARS, lambda c: st.lists(c) | st.dictionaries(st.text(), c), max_leaves=8),
)


@given(_DOCS)
def test_encode_reads_back_as_jsons_own(doc: dict[str, object]) -> None:
    assert json.loads(encode(doc)) == json.loads(json.dumps(doc))


def test_encode_escapes_and_falls_back_for_what_utf8_cannot_carry() -> None:
    doc = {"k\n": ['a"b\\c\t\x00\x1f é 😀', "\udcff lone"], "f": 1.5}
    assert json.loads(encode(doc)) == doc
    assert encode({"a": "é"}) == '{"a":"é"}'.encode()
    assert encode({"n": [1, -2, True, None]}) == b'{"n":[1,-2,true,null]}'


@pytest.mark.parametrize(
    ("body", "doc"),
    [
        (b'{"hello":1}', {"hello": 1}),
        (b'{"exit":-3}', {"exit": -3}),
        (b'{"declined":"x\\ny"}', {"declined": "x\ny"}),
        (b'{"started":12,"x":1}', {"started": 12, "x": 1}),
    ],
)
def test_decode(body: bytes, doc: dict[str, object]) -> None:
    assert _decode(body) == doc


@pytest.mark.parametrize(
    "body", [b'{"a":1', b'{"a":1}}', b"[1]", b'{"a":--1}', b'{"a":-}', b'{"a":\xd9\xa3}', b""]
)
def test_decode_refuses(body: bytes) -> None:
    with pytest.raises(WireError):
        _decode(body)


def test_the_client_imports_no_heavy_module() -> None:
    heavy = ("json", "socket", "signal", "contextlib", "re", "locale", "typing", "pathlib",
             "collections", "enum", "array")  # fmt: skip
    code = (
        "import sys; from agentbox.front import client; client.text_encoding();"
        f" print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
