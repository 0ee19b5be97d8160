"""The official anthropic SDK as the client, through the gateway, to the replay model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from gateway_helpers import CHAT_SCRIPT, running_gateway

TOOL_SCRIPT = {
    "name": "tools",
    "turns": [
        {
            "text": "Writing it.",
            "tool_use": [
                {"name": "Write", "input": {"file_path": "/w/a.py", "content": "x = 1\n" * 50}},
                {"name": "Bash", "input": {"command": "python3 a.py", "description": "run"}},
            ],
            "usage": {
                "input_tokens": 321,
                "output_tokens": 45,
                "cache_creation_input_tokens": 2000,
                "cache_read_input_tokens": 30000,
            },
        }
    ],
}
TOOLS = [{"name": "Write", "description": "write", "input_schema": {"type": "object"}}]


#: The clients a test made, closed after it (their connections, not the collector's).
_made: list[anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def _client(url: str, token: str | None = None, **kw: Any) -> anthropic.Anthropic:
    kw.setdefault("max_retries", 0)
    client = anthropic.Anthropic(api_key=token, base_url=url, **kw)
    _made.append(client)
    return client


def test_sdk_plain_and_streamed_exact_usage(tmp_path: Path) -> None:
    with running_gateway(tmp_path, script=CHAT_SCRIPT, budget=100_000) as gw:
        c = _client(gw.url, gw.token)
        msg = c.messages.create(
            model="claude-anything",
            max_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
        )
        assert msg.content[0].type == "text"
        assert msg.content[0].text == "Hello from the replay model."
        assert msg.model == "test-model"  # the gateway pinned the model
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (11, 7)
        u = gw.usage()
        assert (u.input, u.output, u.requests, u.weighted_total) == (11, 7, 1, 18)

        with c.messages.stream(
            model="other",
            max_tokens=50,
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello from the replay model."},
                {"role": "user", "content": "again"},
            ],
        ) as stream:
            texts = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(texts) == "Second answer."
        assert final.stop_reason == "end_turn"
        assert final.usage.cache_read_input_tokens == 1000
        u = gw.usage()
        assert (u.input, u.output, u.cache_creation, u.cache_read) == (31, 12, 100, 1000)
        # Cache tokens priced by their weights: 1.25 x creation, 0.1 x read.
        assert u.weighted_total == pytest.approx(18 + 25 + 125 + 100)
        assert u.reserved == 0 and u.refusals == {} and not u.exhausted


def test_sdk_streamed_tool_use_intact(tmp_path: Path) -> None:
    with running_gateway(tmp_path, script=TOOL_SCRIPT) as gw:
        c = _client(gw.url, gw.token)
        with c.messages.stream(
            model="x", max_tokens=500, tools=TOOLS, messages=[{"role": "user", "content": "go"}]
        ) as stream:
            events = [ev.type for ev in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert final.stop_reason == "tool_use"
        tools = [b for b in final.content if b.type == "tool_use"]
        assert [t.name for t in tools] == ["Write", "Bash"]
        assert tools[0].input == {"file_path": "/w/a.py", "content": "x = 1\n" * 50}
        assert len({t.id for t in tools}) == 2 and all(t.id.startswith("toolu_") for t in tools)
        u = gw.usage()
        assert (u.input, u.output, u.cache_creation, u.cache_read) == (321, 45, 2000, 30000)
        assert u.weighted_total == pytest.approx(321 + 45 + 2500 + 3000)


def test_sdk_count_tokens_and_token_as_bearer(tmp_path: Path) -> None:
    with running_gateway(tmp_path) as gw:
        c = _client(gw.url, auth_token=gw.token)
        n = c.messages.count_tokens(model="x", messages=[{"role": "user", "content": "hello"}])
        assert n.input_tokens > 0
        u = gw.usage()
        assert u.requests == 1 and u.weighted_total == 0  # counting is free


def test_sdk_sees_upstream_errors_in_anthropic_shape(tmp_path: Path) -> None:
    script = {
        "main": "all",
        "turns": [
            {
                "text": "finally",
                "errors": [
                    {"status": 529, "message": "busy"},
                    {"status": 429, "retry_after": 7, "message": "slow down"},
                ],
            }
        ],
    }
    with running_gateway(tmp_path, script=script) as gw:
        c = _client(gw.url, gw.token)
        args = {"model": "x", "max_tokens": 10, "messages": [{"role": "user", "content": "q"}]}
        with pytest.raises(anthropic.InternalServerError) as e529:
            c.messages.create(**args)
        assert e529.value.status_code == 529
        assert e529.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        with pytest.raises(anthropic.RateLimitError) as e429:
            c.messages.create(**args)
        assert e429.value.response.headers["retry-after"] == "7"
        assert c.messages.create(**args).content[0].text == "finally"  # type: ignore[union-attr]
        u = gw.usage()
        assert u.upstream_errors == 2 and u.requests == 3 and u.reserved == 0
        # Refused upstream calls are not billed.
        assert u.output == 1 and u.weighted_total == u.input + 1


def test_sdk_retries_through_gateway(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [{"text": "ok", "errors": [{"status": 529}]}]}
    with running_gateway(tmp_path, script=script) as gw:
        c = _client(gw.url, gw.token, max_retries=2)
        msg = c.messages.create(
            model="x", max_tokens=10, messages=[{"role": "user", "content": "q"}]
        )
        assert msg.content[0].text == "ok"  # type: ignore[union-attr]
        assert gw.usage().requests == 2


def test_sdk_mid_stream_error_event(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [{"text": "x", "errors": [{"mid_stream": True}]}]}
    with running_gateway(tmp_path, script=script) as gw:
        c = _client(gw.url, gw.token)
        with (
            pytest.raises(anthropic.APIStatusError),
            c.messages.stream(
                model="x", max_tokens=100, messages=[{"role": "user", "content": "q"}]
            ) as stream,
        ):
            stream.get_final_message()
        u = gw.usage()
        # The stream never reported its output: the worst case stays charged.
        assert u.output == 100 and u.reserved == 0
