"""The stream meter reads usage however the stream is cut into chunks (it searches a
chunk's complete events at once and parses only those naming a usage event)."""

from __future__ import annotations

import json
import random

import pytest

from agentbox.gateway._meter import _MAX_EVENT, StreamMeter


def _ev(kind: str, doc: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(doc)}\n\n".encode()


def _stream(deltas: int, huge: bool = False) -> bytes:
    out = [_ev("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "model": "m", "usage": {"input_tokens": 41, "output_tokens": 1,
                                               "cache_read_input_tokens": 7}}})]  # fmt: skip
    for i in range(deltas):
        # Text naming the usage events and "error": parsed, and ignored (not their type).
        text = "message_delta error message_stop" if i % 7 == 0 else f"word {i} "
        out.append(
            _ev(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": text},
                },
            )
        )
        if huge and i == deltas // 2:
            out.append(
                _ev(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "delta": {
                            "type": "text_delta",
                            "text": "message_delta " * (_MAX_EVENT // 10),
                        },
                    },
                )
            )
        if i % 13 == 0:
            out.append(b'event: ping\ndata: {"type": "ping"}\n\n\n')  # an extra blank line
    out.append(_ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                     "usage": {"output_tokens": 333}}))  # fmt: skip
    out.append(_ev("message_stop", {"type": "message_stop"}))
    return b"".join(out)


def _check(m: StreamMeter) -> None:
    assert m.started and m.finished and m.delta_seen and m.error is None
    assert (m.count.input, m.count.output, m.count.cache_read) == (41, 333, 7)
    assert (m.message_id, m.model, m.stop_reason) == ("msg_1", "m", "end_turn")


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("crlf", [False, True])
def test_usage_read_whatever_the_chunking(huge: bool, crlf: bool) -> None:
    data = _stream(120, huge)
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    rnd = random.Random(35)
    whole = StreamMeter()
    whole.feed(data)
    _check(whole)
    for _ in range(40):
        m = StreamMeter()
        i = 0
        while i < len(data):
            n = rnd.choice([1, 2, 7, 64, 500, 4096, 70_000])
            m.feed(data[i : i + n])
            i += n
        _check(m)


def test_an_error_event_is_seen_between_deltas() -> None:
    data = _stream(20).replace(
        b"event: message_delta",
        _ev("error", {"type": "error", "error": {"type": "overloaded_error", "message": "x"}})
        + b"event: message_delta",
    )
    for step in (3, 50, len(data)):
        m = StreamMeter()
        for i in range(0, len(data), step):
            m.feed(data[i : i + step])
        assert m.error == "overloaded_error" and m.count.output == 333
