"""Unit tests of the gateway's parts: ledger, stream meter, registry, usage file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import agentbox.gateway as gateway_pkg
from agentbox.config import Settings
from agentbox.errors import ConfigError, GatewayError
from agentbox.gateway._budget import MIN_OUTPUT_TOKENS, Ledger, Refusal
from agentbox.gateway._meter import StreamMeter, TokenCount, usage_from_message
from agentbox.gateway._usage import Usage, read_usage, write_usage
from agentbox.gateway.registry import DEFAULT_MODEL, load_registry

STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":'
    b'{"input_tokens":12,"output_tokens":1,"cache_creation_input_tokens":5,'
    b'"cache_read_input_tokens":7}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: ping\ndata: {"type": "ping"}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"message_delta is just text here"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":33}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def test_public_surface() -> None:
    assert set(gateway_pkg.__all__) == {
        "DEFAULT_BUDGET", "DEFAULT_MODEL", "DEMO_SCRIPT", "GatewayHandle", "ModelEntry",
        "Registry", "Usage", "gateway_identity", "load_registry", "read_usage", "spawn_gateway",
    }  # fmt: skip
    assert gateway_pkg.DEFAULT_BUDGET == 20_000_000


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50, len(STREAM)])
def test_meter_any_chunking(step: int) -> None:
    m = StreamMeter()
    for i in range(0, len(STREAM), step):
        m.feed(STREAM[i : i + step])
    assert m.finished and m.started and m.delta_seen
    assert (m.count.input, m.count.output) == (12, 33)
    assert (m.count.cache_creation, m.count.cache_read) == (5, 7)


def test_meter_crlf_and_data_only_events() -> None:
    m = StreamMeter()
    m.feed(STREAM.replace(b"\n", b"\r\n"))
    assert m.finished and m.count.output == 33
    m = StreamMeter()
    m.feed(b"".join(line + b"\n" for line in STREAM.split(b"\n") if not line.startswith(b"event")))
    assert m.finished and m.count.input == 12


def test_meter_ignores_garbage_and_lies() -> None:
    m = StreamMeter()
    m.feed(b"data: {not json\n\n")
    m.feed(b'data: {"type":"message_start","message":{"usage":{"input_tokens":-4,'
           b'"output_tokens":"9"}}}\n\n')  # fmt: skip
    m.feed(b'data: {"type":"message_delta","usage":{"output_tokens":true}}\n\n')
    assert m.count.input is None and m.count.output is None
    m.feed(b"event: x\ndata: " + b"y" * (2 << 20) + b"\n\n")  # huge event, not buffered
    m.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n')
    assert m.error == "overloaded_error" and not m.finished


def test_usage_from_message() -> None:
    doc = {"usage": {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 10}}
    c = usage_from_message(json.dumps(doc).encode())
    assert c is not None and (c.input, c.output, c.cache_read) == (3, 4, 10)
    assert usage_from_message(b"{}") is None
    assert usage_from_message(b'{"usage":{"input_tokens":3}}') is None
    assert usage_from_message(b"[1]") is None


def test_ledger_reserve_settle_and_weights() -> None:
    led = Ledger(budget=10_000, model="m")
    r = led.reserve(body_len=1000, max_tokens=500)
    # Worst case: (1000 bytes + 512 overhead) x 1.25 (all could be cache writes) + max_tokens.
    assert r.amount == 1512 * 1.25 + 500 and led.usage.reserved == r.amount
    charge = led.settle(r, TokenCount(100, 50, 400, 1000), complete=True)
    assert charge == 100 + 50 + 400 * 1.25 + 1000 * 0.1
    assert led.usage.reserved == 0 and led.usage.weighted_total == charge
    assert led.settle(r, TokenCount(1, 1), complete=True) == 0  # settles once


def test_ledger_incomplete_keeps_worst_case() -> None:
    led = Ledger(budget=100_000, model="m")
    r = led.reserve(body_len=488, max_tokens=300)
    led.settle(r, TokenCount(input=40), complete=False)  # input read, output unknown
    assert (led.usage.input, led.usage.output) == (40, 300)
    r = led.reserve(body_len=488, max_tokens=300)
    led.settle(r, None, complete=False)  # nothing read: the whole reservation
    assert led.usage.weighted_total == 340 + r.amount


def test_ledger_refusals() -> None:
    led = Ledger(budget=2500, model="m")
    with pytest.raises(Refusal) as e:
        led.reserve(body_len=100, max_tokens=5000)  # 765 input + under 2048 left for output
    assert e.value.reason == "over_budget" and "exhausted" in str(e.value)
    assert led.usage.exhausted  # nothing in flight could free budget
    r1 = led.reserve(body_len=100, max_tokens=1000)  # 765 + 1000
    with pytest.raises(Refusal):
        led.reserve(body_len=100, max_tokens=1000)  # would pass 2500 with r1 held
    led.release(r1)
    r2 = led.reserve(body_len=100, max_tokens=1000)
    led.settle(r2, TokenCount(3000, 1), complete=True)
    with pytest.raises(Refusal) as e:
        led.reserve(body_len=1, max_tokens=1)
    assert e.value.reason == "budget_exhausted"


def test_ledger_clamps_max_tokens_to_what_is_left() -> None:
    """Issue 13 item 3: a max_tokens over the budget is lowered, not refused."""
    led = Ledger(budget=100_000, model="m")
    r = led.reserve(body_len=50_000, max_tokens=128_000)  # Claude Code's first call
    est = 50_000 + 512
    assert r.clamped and r.requested == 128_000
    assert r.max_tokens == math.floor(100_000 - est * 1.25)
    assert r.amount <= 100_000 and led.usage.clamped == 1
    assert not led.usage.exhausted
    led.settle(r, TokenCount(input=est, output=r.max_tokens), complete=True)
    # What is left (under input estimate + MIN_OUTPUT_TOKENS) refuses the next call.
    with pytest.raises(Refusal) as e:
        led.reserve(body_len=50_000, max_tokens=128_000)
    assert e.value.reason == "over_budget" and led.usage.exhausted
    # A request that fits is never touched.
    led2 = Ledger(budget=100_000, model="m")
    r = led2.reserve(body_len=100, max_tokens=4000)
    assert (r.max_tokens, r.clamped, led2.usage.clamped) == (4000, False, 0)


def test_ledger_clamp_floor() -> None:
    led = Ledger(budget=765 + MIN_OUTPUT_TOKENS, model="m")
    r = led.reserve(body_len=100, max_tokens=50_000)
    assert r.max_tokens == MIN_OUTPUT_TOKENS  # exactly the floor still goes
    led.release(r)
    led = Ledger(budget=765 + MIN_OUTPUT_TOKENS - 1, model="m")
    with pytest.raises(Refusal):
        led.reserve(body_len=100, max_tokens=50_000)
    # A small request that fits in full is not held to the floor.
    assert led.reserve(body_len=100, max_tokens=100).max_tokens == 100


def test_usage_file_roundtrip_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "u.json"
    write_usage(p, Usage(model="m", budget=5, input=3, refusals={"auth": 2}))
    u = read_usage(p)
    assert (u.model, u.input, u.refusals, u.remaining) == ("m", 3, {"auth": 2}, 5)
    assert list(tmp_path.iterdir()) == [p]  # no temp file left behind
    p.write_text("{")
    with pytest.raises(GatewayError, match="not valid"):
        read_usage(p)
    with pytest.raises(GatewayError, match="cannot read"):
        read_usage(tmp_path / "missing.json")


def test_builtin_registry(settings: Settings) -> None:
    reg = load_registry(settings)
    demo = reg.get(DEFAULT_MODEL)
    assert demo.kind == "replay" and demo.replay_script is not None
    assert demo.replay_script.is_file() and demo.key_env is None
    with pytest.raises(ConfigError, match=r"unknown model 'gpt-9'.*replay-demo"):
        reg.get("gpt-9")
    with pytest.raises(ConfigError):
        reg.get(["not", "a", "name"])  # type: ignore[arg-type]


def test_registry_file(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    (tmp_path / "s.yaml").write_text("turns: []\n")  # checked at load (issue 13.4)
    f.write_text(
        '[models.local]\nkind = "compatible"\nupstream = "http://127.0.0.1:8081"\n'
        'upstream_model = "qwen2.5-coder"\ncache_read_weight = 0.5\n'
        '[models.scripted]\nkind = "replay"\nupstream = "s.yaml"\n'
    )
    reg = load_registry(Settings(models_file=f))
    local = reg.get("local")
    assert local.target_model == "qwen2.5-coder" and local.cache_read_weight == 0.5
    assert "thinking" in local.stripped_fields and not local.has_count_tokens
    assert not local.passes_beta
    assert reg.get("scripted").upstream == str(tmp_path / "s.yaml")
    assert reg.names() == ["local", "scripted"]
    for bad in (
        "",
        "[models.x]\nkind = 'other'\nupstream = 'http://h'\n",
        "[models.x]\nkind = 'anthropic'\nupstream = 'file:///etc/passwd'\n",
        "[models.x]\nkind = 'anthropic'\nupstream = 'https://h'\nsurprise = 1\n",
        "[models.'bad name']\nkind = 'replay'\nupstream = 's'\n",
        "[models.x\n",
    ):
        f.write_text(bad)
        with pytest.raises(ConfigError, match="registry"):
            load_registry(path=f)
