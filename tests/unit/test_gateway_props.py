"""Property tests: whatever body a client sends, the gateway answers, never with a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_helpers import RunningGateway, running_gateway

SCRIPT = {
    "name": "props",
    "main": "all",
    "turns": [
        {"text": "one", "tool_use": [{"name": "Bash", "input": {"command": "true"}}]},
        {"text": "two"},
    ],
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.text(max_size=5),
         "content": st.one_of(st.text(max_size=30), st.lists(json_values, max_size=3))}
    ),
    json_values,
)  # fmt: skip
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
             "content": st.one_of(st.text(max_size=40), st.lists(blocks, max_size=3), json_values)}
        ),
        json_values,
    ),
    max_size=5,
)  # fmt: skip
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "max_tokens": st.one_of(st.integers(-5, 3000), json_values),
        "messages": st.one_of(messages, json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "system": st.one_of(st.text(max_size=50), st.lists(blocks, max_size=2), json_values),
        "tools": st.one_of(st.lists(json_values, max_size=2), json_values),
        "metadata": json_values,
        "thinking": json_values,
        "temperature": json_values,
    },
)


#: One client for all examples (a new httpx client per request costs an SSL context).
CLIENT = httpx.Client(timeout=30)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tmp: Path = tmp_path_factory.mktemp("props")
    with running_gateway(tmp, script=SCRIPT, budget=10**12, max_body=64_000) as g:
        yield g


def _check(r: httpx.Response) -> None:
    assert r.status_code in {200, 400, 403, 404, 413}, (r.status_code, r.text)
    if r.status_code != 200:
        doc = r.json()
        assert doc["type"] == "error" and isinstance(doc["error"]["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "event: message_stop" in r.text or "event: error" in r.text
    else:
        doc = r.json()
        assert doc.get("type") == "message" or isinstance(doc.get("input_tokens"), int)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=bodies, route=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_any_json_body(gw: RunningGateway, body: dict[str, Any], route: str) -> None:
    r = CLIENT.post(gw.url + route, content=json.dumps(body), headers=gw.auth())
    _check(r)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(raw=st.binary(max_size=300))
def test_any_bytes(gw: RunningGateway, raw: bytes) -> None:
    r = CLIENT.post(gw.url + "/v1/messages", content=raw, headers=gw.auth())
    _check(r)


def test_never_a_500_was_logged(gw: RunningGateway) -> None:
    u = gw.usage()
    assert u.reserved == 0
    assert "internal" not in json.dumps(u.refusals)
