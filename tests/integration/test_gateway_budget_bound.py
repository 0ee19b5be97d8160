"""No request shape the allow-lists admit can make the metered total exceed the budget.

Issue 11 item 3: with the allow-lists in place, the reservation must be a true
upper bound for an honest upstream, concurrency included. The upstream here is
honest and independent of the gateway's estimator: it parses what it receives
and reports usage no larger than what the real API could bill for it (one token
per body byte plus 346 for the tool-use prompt, 1,600 per image, 600 pages of
3,000 tokens per PDF, one tool definition per ``tool_reference``), split at
random between input, cache writes and cache reads, and up to ``max_tokens`` of
output, streamed or not. Hypothesis draws batches of admitted requests (text,
images, PDFs, tool references, tools, any ``max_tokens``) sent concurrently
against a small budget. A ``max_tokens`` past what is left is clamped, not
refused; the clamped request must still fit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentbox.gateway._serve import ServerGroup, bind, parse_listen
from agentbox.gateway._wire import read_body, send_json
from gateway_helpers import ThreadServers, replay_entry, running_gateway

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
PDF = "JVBERi0xLjAKJeLjz9MK"


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


class HonestUpstream:
    """A Messages API server that never reports more than the real API could bill."""

    def __init__(self, *, worst: bool = False) -> None:
        self.worst = worst
        self.weighted = 0.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = await read_body(receive, 1 << 26)
        req = json.loads(body)
        blocks = list(_walk(req.get("messages")))
        images = sum(1 for b in blocks if b.get("type") == "image")
        pdfs = sum(1 for b in blocks if b.get("type") == "document" and
                   b.get("source", {}).get("type") == "base64")  # fmt: skip
        refs = sum(1 for b in blocks if b.get("type") == "tool_reference")
        tools = len(json.dumps(req.get("tools", [])))
        most = len(body) + 346 + 1600 * images + 600 * 3000 * pdfs + refs * tools
        rng = random.Random(hashlib.sha256(body).digest())
        total = most if self.worst else rng.randint(0, most)
        cw = total if self.worst else rng.randint(0, total)
        cr = rng.randint(0, total - cw)
        inp = total - cw - cr
        out = req["max_tokens"] if self.worst else rng.randint(0, req["max_tokens"])
        usage = {"input_tokens": inp, "cache_creation_input_tokens": cw,
                 "cache_read_input_tokens": cr}  # fmt: skip
        self.weighted += inp + out + cw * 1.25 + cr * 0.1
        msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
               "usage": {**usage, "output_tokens": out}}  # fmt: skip
        if not req.get("stream"):
            await send_json(send, 200, json.dumps(msg).encode())
            return
        start = {**msg, "content": [], "usage": {**usage, "output_tokens": 1}}
        events = [
            ("message_start", {"type": "message_start", "message": start}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                               "usage": {"output_tokens": out}}),
            ("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip
        hdrs = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        for name, data in events:
            chunk = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Upstream:
    def __init__(self, worst: bool = False) -> None:
        self.app = HonestUpstream(worst=worst)
        sock = bind(parse_listen("tcp:127.0.0.1:0"))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.servers = ThreadServers(ServerGroup([(self.app, sock)]))

    def __enter__(self) -> _Upstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.servers.stop()


text_block = st.builds(lambda s: {"type": "text", "text": s}, st.text(max_size=400))
image_block = st.just(
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
)
pdf_block = st.just(
    {"type": "document",
     "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}}
)  # fmt: skip
ref_block = st.just({"type": "tool_reference", "tool_name": "Read"})
result_block = st.builds(
    lambda inner: {"type": "tool_result", "tool_use_id": "t1", "content": inner},
    st.lists(st.one_of(text_block, image_block, ref_block), max_size=4),
)
user_content = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(text_block, image_block, pdf_block, result_block), min_size=1, max_size=6),
)
TOOL = {"name": "Read", "description": "read " * 40, "defer_loading": True,
        "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}}}  # fmt: skip
requests = st.fixed_dictionaries(
    {
        # Past the budget too: those are clamped to what is left (issue 13 item 3).
        "max_tokens": st.one_of(st.integers(1, 4000), st.integers(4000, 200_000)),
        "messages": st.lists(
            st.builds(lambda c: {"role": "user", "content": c}, user_content),
            min_size=1,
            max_size=3,
        ),
        "stream": st.booleans(),
    },
    optional={"tools": st.just([TOOL]), "system": st.text(max_size=200)},
)


async def _send_all(url: str, auth: dict[str, str], batch: list[dict[str, Any]]) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        rs = await asyncio.gather(
            *(client.post(url + "/v1/messages", json=b, headers=auth) for b in batch)
        )
        for r in rs:
            await r.aread()
    return [r.status_code for r in rs]


SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(batch=st.lists(requests, min_size=1, max_size=10), budget=st.integers(2_000, 60_000))
def test_admitted_shapes_never_overdraw(tmp_path: Path, batch: list[Any], budget: int) -> None:
    with (
        _Upstream() as up,
        running_gateway(tmp_path, upstream=up.url, budget=budget,
                        entry=replay_entry(kind="anthropic")) as gw,
    ):  # fmt: skip
        statuses = asyncio.run(_send_all(gw.url, gw.auth(), batch))
        u = gw.usage()
    assert set(statuses) <= {200, 403}, statuses
    assert u.reserved == 0
    assert u.weighted_total == pytest.approx(up.app.weighted)  # complete answers: exact
    assert u.weighted_total <= budget, (u, batch)


def test_worst_case_upstream_at_the_edge(tmp_path: Path) -> None:
    """The honest upstream's worst case for an image request still fits the reservation."""
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
    ]}]}  # fmt: skip
    with (
        _Upstream(worst=True) as up,
        running_gateway(tmp_path, upstream=up.url, budget=8_000,
                        entry=replay_entry(kind="anthropic")) as gw,
    ):  # fmt: skip
        statuses = asyncio.run(_send_all(gw.url, gw.auth(), [body] * 4))
        u = gw.usage()
    assert 200 in statuses and 403 in statuses  # some fit, the rest were refused up front
    assert 0 < u.weighted_total <= 8_000


def test_control_without_image_allowance_overdraws(tmp_path: Path) -> None:
    """Positive control: an entry that reserves nothing for images lets the total pass the
    budget, so the property above can fail."""
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
    ]}]}  # fmt: skip
    with (
        _Upstream(worst=True) as up,
        running_gateway(tmp_path, upstream=up.url, budget=1_200,
                        entry=replay_entry(kind="anthropic", image_tokens=0)) as gw,
    ):  # fmt: skip
        statuses = asyncio.run(_send_all(gw.url, gw.auth(), [body]))
        u = gw.usage()
    assert statuses == [200]
    assert u.weighted_total > 1_200


def test_clamped_first_call_fits_worst_case(tmp_path: Path) -> None:
    """Claude Code's shape (~50 KB prompt, max_tokens 128000) under a 100k budget: the
    first call goes through with max_tokens lowered, and even an upstream that bills
    every byte as a cache write and every allowed output token stays within budget."""
    body = {"max_tokens": 128_000, "stream": True,
            "messages": [{"role": "user", "content": "x" * 50_000}]}  # fmt: skip
    with (
        _Upstream(worst=True) as up,
        running_gateway(tmp_path, upstream=up.url, budget=100_000,
                        entry=replay_entry(kind="anthropic")) as gw,
    ):  # fmt: skip
        statuses = asyncio.run(_send_all(gw.url, gw.auth(), [body]))
        u = gw.usage()
        again = asyncio.run(_send_all(gw.url, gw.auth(), [body]))
        after = gw.usage()
    assert statuses == [200] and u.clamped == 1
    assert 2048 <= u.output < 128_000  # the worst-case upstream used every allowed token
    assert u.weighted_total == pytest.approx(up.app.weighted) and u.weighted_total <= 100_000
    assert again == [403] and after.exhausted and after.refusals == {"over_budget": 1}
