"""Issue 27 items 1 and 5: the replay model speaks today's API, and the gateway meters it.

Thinking blocks (with signatures, streamed as ``thinking_delta`` then ``signature_delta``)
are output tokens; the stop reasons ``refusal`` and ``model_context_window_exceeded``
reach the request log and the transcript; one-hour cache writes are metered apart and
priced at their own rate; an upstream that has no such model is recorded so that the
task fails naming the registry entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.config import Settings
from agentbox.gateway import read_requests
from agentbox.gateway._price import Price
from agentbox.launcher._usage_words import model_error
from agentbox.transcript import _model_stops, _turn_tokens
from gateway_helpers import replay_entry, running_gateway

MSG = {"model": "claude-opus-4-1", "max_tokens": 4000,
       "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
THOUGHT = "Let me think about this step by step. " * 5


def _post(gw: Any, **body: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/messages", json={**MSG, **body}, headers=gw.auth(), timeout=30)


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_thinking_streamed_with_its_signature_and_metered_as_output(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [
        {"thinking": THOUGHT, "text": "done", "usage": {"input_tokens": 10, "output_tokens": 777}},
        {"thinking": THOUGHT, "text": "again"},
    ]}  # fmt: skip
    with running_gateway(tmp_path, script=script) as gw:
        r = _post(gw, stream=True)
        evs = _events(r.text)
        starts = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
        assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta" and e["index"] == 0]
        assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
        assert deltas[-1]["type"] == "signature_delta" and len(deltas[-1]["signature"]) > 40
        assert [d["type"] for d in deltas[:-1]] == ["thinking_delta"] * (len(deltas) - 1)
        assert gw.usage().output == 777  # what the upstream said: thinking included
        # Not declared: the replay counts the thinking's characters as output too.
        follow = [*MSG["messages"], {"role": "assistant", "content": "done"},
                  {"role": "user", "content": "more"}]  # fmt: skip
        doc = _post(gw, messages=follow).json()
        assert doc["content"][0]["type"] == "thinking" and doc["content"][0]["signature"]
        assert doc["usage"]["output_tokens"] == (len(THOUGHT) + len("again")) // 4
        assert gw.usage().output == 777 + doc["usage"]["output_tokens"]


@pytest.mark.parametrize("reason", ["refusal", "model_context_window_exceeded"])
def test_model_stops_reach_the_request_log_and_the_transcript(tmp_path: Path, reason: str) -> None:
    script = {"main": "all", "turns": [{"text": "I can't help with that.", "stop_reason": reason}]}
    with running_gateway(tmp_path, script=script) as gw:
        r = _post(gw, stream=True)
        delta = next(e for e in _events(r.text) if e["type"] == "message_delta")
        assert delta["delta"]["stop_reason"] == reason
        gw.usage()
        (rec,) = read_requests(gw.usage_file)
        # The request log shows what the agent asked for, and what ran.
        assert rec.stop_reason == reason and rec.asked == "claude-opus-4-1"
    task_root = tmp_path / "task"
    task_root.mkdir()
    (task_root / "usage.json").write_bytes(gw.usage_file.read_bytes())
    (task_root / "requests.jsonl").write_bytes((tmp_path / "requests.jsonl").read_bytes())
    (stop,) = _model_stops(_turn_tokens(task_root, []))
    assert stop.kind == "stop" and reason in stop.text
    assert ("refused" if reason == "refusal" else "context window is full") in stop.text


def test_one_hour_cache_writes_metered_apart_and_priced_at_their_rate(tmp_path: Path) -> None:
    price = Price(input=2.0, output=10.0, cache_write=2.5, cache_write_1h=4.0, cache_read=0.1)
    script = {"main": "all", "turns": [{"text": "ok", "usage": {
        "input_tokens": 100, "output_tokens": 50, "cache_creation_input_tokens": 1000,
        "cache_creation_1h_input_tokens": 400, "cache_read_input_tokens": 2000}}]}  # fmt: skip
    body = {"system": [{"type": "text", "text": "s",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}  # fmt: skip
    with running_gateway(tmp_path, script=script, entry=replay_entry(price=price)) as gw:
        assert _post(gw, stream=True, **body).status_code == 200
        u = gw.usage()
    assert (u.cache_creation, u.cache_creation_1h) == (1000, 400)
    want = (100 * 2.0 + 50 * 10.0 + 600 * 2.5 + 400 * 4.0 + 2000 * 0.1) / 1e6
    assert u.cost_usd == pytest.approx(want)
    # The token budget weighs a one-hour write at 2x (a five-minute one at 1.25x).
    assert u.weighted_total == pytest.approx(100 + 50 + 600 * 1.25 + 400 * 2.0 + 2000 * 0.1)


def test_an_upstream_without_the_model_fails_the_task_naming_the_entry(tmp_path: Path) -> None:
    error = {"status": 404, "type": "not_found_error", "message": "model: claude-sonnet-4-5"}
    script = {"main": "all", "turns": [{"text": "never", "errors": [error]}]}
    entry = replay_entry(name="sonnet", upstream_model="claude-sonnet-4-5")
    with running_gateway(tmp_path, script=script, entry=entry) as gw:
        r = _post(gw)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        u = gw.usage()
    assert u.model_error == "model: claude-sonnet-4-5"
    models = tmp_path / "models.toml"
    (tmp_path / "s.yaml").write_text("turns: []\n")
    models.write_text('[models.sonnet]\nkind = "replay"\nupstream = "s.yaml"\n'
                      'upstream_model = "claude-sonnet-4-5"\n')  # fmt: skip
    why = model_error(Settings(models_file=models), u)
    assert why is not None
    assert "'sonnet'" in why and "'claude-sonnet-4-5'" in why and "update the registry" in why
