"""Issue 27: current model ids, prices per registry entry, cost in dollars, a dollar budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentbox.errors import ConfigError, Refusal
from agentbox.gateway._budget import Ledger
from agentbox.gateway._meter import StreamMeter, TokenCount
from agentbox.gateway._price import Price, format_usd
from agentbox.gateway.registry import builtin_registry, load_registry

SONNET = Price(input=2.0, output=10.0, cache_write=2.5, cache_write_1h=4.0, cache_read=0.1)


def test_builtin_registry_names_current_models_with_prices() -> None:
    reg = builtin_registry()
    ids = {e.name: e.target_model for e in reg}
    assert ids == {"opus": "claude-opus-5-5", "sonnet": "claude-sonnet-5-5",
                   "haiku": "claude-haiku-5-5", "replay-demo": "replay-demo"}  # fmt: skip
    for name in ("opus", "sonnet", "haiku"):
        e = reg.get(name)
        assert e.price is not None and e.retired is None and not e.scripted
    assert reg.get("sonnet").price == SONNET
    assert reg.get("replay-demo").price is None and reg.get("replay-demo").scripted


def test_default_is_a_real_model_when_its_key_is_set() -> None:
    reg = builtin_registry()
    name, why = reg.default_for({"ANTHROPIC_API_KEY": "k"})
    assert name == "sonnet" and "ANTHROPIC_API_KEY is set" in why
    name, why = reg.default_for({})
    assert name == "replay-demo" and "scripted" in why and "ANTHROPIC_API_KEY" in why


def test_registry_price_table_and_its_errors(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text(
        '[models.a]\nkind = "anthropic"\nupstream = "https://x"\n'
        'upstream_model = "claude-sonnet-4-5"\n'
        "[models.a.price]\ninput = 3\noutput = 15\n"
        '[models.b]\nkind = "compatible"\nupstream = "http://127.0.0.1:1"\n'
    )
    reg = load_registry(path=f)
    a = reg.get("a")
    assert a.price == Price(input=3.0, output=15.0)
    # Defaults of the cache prices: 1.25x, 2x and 0.1x input.
    want = {"input": 3.0, "output": 15.0, "cache_write": 3.75, "cache_write_1h": 6.0,
            "cache_read": pytest.approx(0.3)}  # fmt: skip
    assert a.price.to_json() == want
    assert a.retired == "2026-11-30"  # doctor warns about it
    assert reg.get("b").price is None
    f.write_text('[models.a]\nkind = "replay"\nupstream = "s.yaml"\n[models.a.price]\ninput = -1\n')
    (tmp_path / "s.yaml").write_text("turns: []\n")
    with pytest.raises(ConfigError) as err:
        load_registry(path=f)
    assert "[models.a] price.input: must be a number >= 0" in str(err.value)
    assert "price.output: is required" in str(err.value)


def test_cost_is_tokens_times_prices_with_one_hour_writes_apart() -> None:
    # 1,000 input, 500 output (thinking included), 4,000 cache writes of which 1,000
    # for an hour, 10,000 cache reads.
    cost = SONNET.cost(input=1000, output=500, cache_creation=4000, cache_creation_1h=1000,
                       cache_read=10_000)  # fmt: skip
    assert cost == pytest.approx((1000 * 2 + 500 * 10 + 3000 * 2.5 + 1000 * 4 + 10_000 * 0.1) / 1e6)
    assert format_usd(None) == "price unknown" and format_usd(0.01234) == "$0.0123"


def test_stream_meter_reads_one_hour_cache_writes() -> None:
    m = StreamMeter()
    start = {"type": "message_start", "message": {"id": "m", "model": "x", "usage": {
        "input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 300,
        "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200},
    }}}  # fmt: skip
    m.feed(f"event: message_start\ndata: {json.dumps(start)}\n\n".encode())
    assert (m.count.cache_creation, m.count.cache_creation_1h) == (300, 200)


def test_ledger_charges_dollars_and_refuses_at_the_dollar_budget() -> None:
    led = Ledger(budget=10**9, model="m", price=SONNET, budget_usd=0.05)
    r = led.reserve(body_len=1000, max_tokens=1000)
    held = led.usage.reserved_usd
    assert held == pytest.approx((1512 * 2.5 + 1000 * 10) / 1e6)  # input may be 5m writes
    long = led.reserve(body_len=1000, max_tokens=1000, long_cache=True)
    assert long.amount_usd == pytest.approx((1512 * 4.0 + 1000 * 10) / 1e6)  # or 1h writes
    led.release(long)
    led.settle(r, TokenCount(input=1000, output=500, cache_creation=0, cache_read=0),
               complete=True)  # fmt: skip
    assert led.usage.cost_usd == pytest.approx((1000 * 2 + 500 * 10) / 1e6)
    assert led.usage.reserved_usd == 0
    # max_tokens past what the dollars left allow is clamped to fit.
    r = led.reserve(body_len=1000, max_tokens=100_000)
    assert r.clamped and led.usage.cost_usd + led.usage.reserved_usd <= 0.05 + 1e-12
    led.release(r)
    with pytest.raises(Refusal) as ref:
        led.reserve(body_len=50_000, max_tokens=100_000)
    assert ref.value.reason == "over_budget" and "dollar budget" in str(ref.value)


def test_a_dollar_budget_needs_a_price() -> None:
    with pytest.raises(ValueError, match="no price"):
        Ledger(budget=100, model="m", budget_usd=1.0)
    assert Ledger(budget=100, model="m").usage.cost_usd is None  # unknown, never $0


def test_doctor_warns_about_a_retired_model_id(tmp_path: Path) -> None:
    from agentbox.cli._doctor import _models
    from agentbox.config import Settings

    f = tmp_path / "models.toml"
    f.write_text('[models.sonnet]\nkind = "anthropic"\nupstream = "https://api.anthropic.com"\n'
                 'upstream_model = "claude-sonnet-4-5"\n')  # fmt: skip
    check = _models(Settings(models_file=f))
    assert check.status == "partial" and not check.essential
    assert "claude-sonnet-4-5, retired by its provider on 2026-11-30" in check.facility.detail
    assert "update the registry" in check.facility.fix
    assert _models(Settings()).status == "ok"  # the built-in registry is current


def test_cost_shown_beside_tokens_in_mcp_status_and_logs() -> None:
    from agentbox.cli._logs import event_lines
    from agentbox.launcher.api import TaskInfo, TokenUsage
    from agentbox.mcp._format import info_dict
    from agentbox.transcript._model import Event

    base = {"id": "t1", "status": "done", "repo": "/r", "task": "x", "model": "sonnet",
            "budget": 10, "deadline": 60.0, "created_at": 0.0}  # fmt: skip
    priced = TaskInfo(**base, tokens=TokenUsage(input=10, output=5, cost_usd=0.0123))
    assert info_dict(priced)["cost_usd"] == 0.0123
    assert info_dict(TaskInfo(**base))["cost_usd"] is None  # unknown, never 0
    ev = Event(seq=0, source="agent", kind="text", text="hi",
               tokens=TokenUsage(input=10, output=5, cost_usd=0.0123))  # fmt: skip
    assert "$0.0123" in event_lines(ev, full=False)[0].plain
