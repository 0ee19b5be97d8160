"""Parsing a request body costs at most a small multiple of its size, whatever its shape.

Issue 11 item 4: 16 concurrent 32 MiB bodies of ``{},{},…`` took the gateway to
2.1 GB; ``json.loads`` of such a body costs ~25 times its size. The gateway
now measures a body's worst-case parse cost before parsing
(:func:`agentbox.gateway._wire.json_cost`) and refuses what would cost more
than ``COST_RATIO`` times the body plus ``COST_SLACK``. Measured here with
tracemalloc on the real parser, for shapes hypothesis draws and repeats.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentbox.gateway._wire import COST_RATIO, COST_SLACK, json_cost, parse_json_object

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["", "a", "é", "€", "😀", "\u0000"]),
)
units = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=8,
)  # fmt: skip


def _peak(body: bytes) -> tuple[int, bool]:
    """(peak bytes allocated while parsing, whether the parser refused it)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        doc = parse_json_object(body)
        refused = False
    except ValueError as exc:
        assert "too dense" in str(exc) or "nested" in str(exc), exc
        doc, refused = None, True
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del doc
    return peak, refused


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(unit=units, copies=st.integers(1, 60_000), ascii_only=st.booleans())
# Found by hypothesis: a list's first element follows no comma, and a string that is not
# a cached one-character string costs ~78 bytes of its own (the estimate was 10 % short).
@example(unit=["\u0100"], copies=15731, ascii_only=False)
def test_parse_peak_is_bounded(unit: Any, copies: int, ascii_only: bool) -> None:
    body = json.dumps({"messages": [unit] * copies}, ensure_ascii=ascii_only,
                      separators=(",", ":")).encode("utf-8", "surrogatepass")  # fmt: skip
    peak, refused = _peak(body)
    if not refused:
        assert peak <= COST_RATIO * len(body) + COST_SLACK, (peak, len(body))
        # The estimate itself bounds the parse (plus the small fixed cost of the call).
        assert peak <= json_cost(body) + (256 << 10), (peak, json_cost(body), len(body))


@pytest.mark.parametrize(
    "element",
    [b"{}", b"[]", b'{"a":1}', b'"ab"', b"1.5", b"1e9", b'"\\u20ac"', b'{"k":{}}', b"[[[]]]"],
)
def test_pathological_shapes_refused_or_bounded(element: bytes) -> None:
    body = b'{"messages":[' + b",".join([element] * 400_000) + b"]}"
    peak, refused = _peak(body)
    assert refused or peak <= COST_RATIO * len(body) + COST_SLACK, (peak, len(body))


def test_real_claude_code_shapes_pass() -> None:
    """A long conversation of tool calls and an image, as Claude Code sends them."""
    turn = [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Reading the file, then running the tests."},
            {"type": "tool_use", "id": "toolu_01ABCDEFGHIJKLMNOPQRSTUV", "name": "Read",
             "input": {"file_path": "/workspace/src/module.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01ABCDEFGHIJKLMNOPQRSTUV",
             "content": "     1\tdef f(x):\n     2\t    return x + 1\n" * 20}]},
    ]  # fmt: skip
    image = {"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/jpeg", "data": "A" * 650_000}}]}  # fmt: skip
    body = json.dumps({"max_tokens": 128000, "messages": turn * 400 + [image]}).encode()
    assert len(body) > 1_000_000
    peak, refused = _peak(body)
    assert not refused
    assert json_cost(body) < 4 * len(body)
    assert peak < 4 * len(body)
