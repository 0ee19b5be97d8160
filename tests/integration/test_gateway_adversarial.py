"""A hostile client against the gateway: credentials, routes, headers, bodies, budget."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.errors import ConfigError, PolicyRefused
from agentbox.gateway._serve import parse_listen
from gateway_helpers import CHAT_SCRIPT, replay_entry, running_gateway, running_replay

MSG = {"model": "x", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


def _post(gw: Any, body: Any = None, *, path: str = "/v1/messages", **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", gw.auth())
    content = kw.pop("content", None)
    if content is None:
        content = json.dumps(MSG if body is None else body).encode()
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=30, **kw)


def _is_error(r: httpx.Response, status: int, err_type: str) -> None:
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == err_type, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    with running_gateway(tmp_path, script=CHAT_SCRIPT, max_body=20_000) as g:
        yield g


def test_token_required_and_compared_exactly(gw: Any) -> None:
    v = {"anthropic-version": "2023-06-01"}
    for headers in (
        v,
        {**v, "x-api-key": "wrong"},
        {**v, "x-api-key": gw.token[:-1]},
        {**v, "x-api-key": gw.token + "x"},
        {**v, "authorization": gw.token},
        {**v, "authorization": f"Basic {gw.token}"},
        {**v, "authorization": f"bearer {gw.token}"},
    ):
        _is_error(_post(gw, headers=headers), 401, "authentication_error")
    # Two credentials, even if one is right, are refused: no ambiguity to exploit.
    both = [("x-api-key", gw.token), ("x-api-key", "other")]
    _is_error(_post(gw, headers=both), 401, "authentication_error")
    assert _post(gw, headers={"authorization": f"Bearer {gw.token}"}).status_code == 200
    u = gw.usage()
    assert u.refusals == {"auth": 8} and u.weighted_total == 18


def test_only_two_routes_and_post(gw: Any) -> None:
    for method, path in (
        ("GET", "/v1/messages"),
        ("PUT", "/v1/messages"),
        ("DELETE", "/v1/messages/count_tokens"),
        ("POST", "/v1/complete"),
        ("POST", "/v1/models"),
        ("POST", "/v1/messages/"),
        ("POST", "/v1/messages/batches"),
        ("POST", "/v1//messages"),
        ("POST", "/v1/messages;x"),
        ("POST", "/"),
        ("OPTIONS", "/v1/messages"),
    ):
        r = httpx.request(method, gw.url + path, headers=gw.auth(), content=json.dumps(MSG))
        _is_error(r, 404, "not_found_error")
    # The query string Claude Code sends works.
    assert _post(gw, path="/v1/messages?beta=true").status_code == 200
    assert gw.usage().refusals == {"not_found": 11}


def test_headers_never_smuggled_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY_FOR_TEST", "sk-upstream-secret")
    entry = replay_entry(kind="compatible", key_env="UPSTREAM_KEY_FOR_TEST")
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, entry=entry) as gw,
    ):
        hostile = [
            ("x-api-key", gw.token),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "prompt-caching-2024-07-31"),
            ("host", "evil.example"),
            ("connection", "keep-alive, x-evil"),
            ("x-evil", "1"),
            ("keep-alive", "timeout=999"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("cookie", "session=steal-me"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-host", "evil.example"),
            ("forwarded", "for=10.0.0.1"),
            ("anthropic-dangerous-direct-browser-access", "true"),
            ("x-stainless-retry-count", "0"),
            ("user-agent", "claude-cli/2.1.332"),
        ]
        body = {
            **MSG,
            "model": {"$ne": "claude"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": []},
            "metadata": {"user_id": "u"},
        }
        r = _post(gw, body, headers=hostile, path="/v1/messages?beta=true&evil=1")
        assert r.status_code == 200, r.text
        # Response headers: nothing of the upstream's beyond the allow-list.
        assert "server" not in r.headers and "x-evil" not in r.headers
        [rec] = up.requests()
        names = [k.lower() for k, _ in rec["headers"]]
        got = {k.lower(): v for k, v in rec["headers"]}
        assert len(names) == len(set(names)), names  # no duplicated header
        allowed = {
            "host", "accept", "accept-encoding", "connection", "user-agent",
            "content-length", "content-type", "anthropic-version", "x-api-key", "authorization",
        }  # fmt: skip
        assert set(names) <= allowed, set(names) - allowed
        assert got["x-api-key"] == "sk-upstream-secret"
        assert got["authorization"] == "Bearer sk-upstream-secret"
        assert got["host"].startswith("127.0.0.1:")
        assert got.get("connection", "keep-alive") == "keep-alive"  # never the client's list
        assert gw.token not in json.dumps(rec)
        # compatible upstreams do not get anthropic-beta; the query keeps only beta=true.
        assert "anthropic-beta" not in got and rec["query"] == "beta=true"
        # Model pinned; fields the compatible kind does not take stripped; others kept.
        assert rec["body"]["model"] == "test-model"
        assert "thinking" not in rec["body"] and "context_management" not in rec["body"]
        assert rec["body"]["metadata"] == {"user_id": "u"}


def test_anthropic_beta_forwarded_to_anthropic_kinds(tmp_path: Path) -> None:
    """Allow-listed betas pass (in order, once); unknown ones are dropped (issue 11.3)."""
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url) as gw,
    ):
        beta = "a-1, claude-code-20250219,b-2,effort-2025-11-24"
        r = _post(gw, headers={**gw.auth(), "anthropic-beta": beta})
        assert r.status_code == 200
        got = {k.lower(): v for k, v in up.requests()[0]["headers"]}
        assert got["anthropic-beta"] == "claude-code-20250219,effort-2025-11-24"
        assert "x-api-key" not in got  # no key configured: the client's token is not sent


def test_oversized_bodies(gw: Any) -> None:
    big = {**MSG, "messages": [{"role": "user", "content": "x" * 30_000}]}
    _is_error(_post(gw, big), 413, "request_too_large")

    def chunks() -> Any:
        for _ in range(40):
            yield b"x" * 1000

    r = httpx.post(gw.url + "/v1/messages", content=chunks(), headers=gw.auth())
    _is_error(r, 413, "request_too_large")
    assert gw.usage().refusals == {"too_large": 2}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'"str"',
        b"\xff\xfe{}",
        b'{"max_tokens": NaN, "messages": []}',
        b'{"max_tokens": Infinity, "messages": []}',
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
    ],
)
def test_malformed_json(gw: Any, content: bytes) -> None:
    _is_error(_post(gw, content=content), 400, "invalid_request_error")


@pytest.mark.parametrize(
    "patch",
    [
        {"max_tokens": "20"},
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"max_tokens": 2.5},
        {"max_tokens": True},
        {"max_tokens": 10**30},
        {"max_tokens": None},
        {"messages": "hi"},
        {"messages": {"role": "user"}},
        {"stream": "yes"},
        {"stream": 1},
        {"system": 5},
        {"tools": {"name": "Bash"}},
    ],
)
def test_bad_field_types_rejected(gw: Any, patch: dict[str, Any]) -> None:
    _is_error(_post(gw, {**MSG, **patch}), 400, "invalid_request_error")
    assert gw.usage().weighted_total == 0


@pytest.mark.parametrize(
    "model", [123, None, [], {}, ["claude-opus"], {"name": "claude"}, True, "a" * 10_000, ""]
)
def test_odd_model_values_are_pinned(gw: Any, model: Any) -> None:
    r = _post(gw, {**MSG, "model": model})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "test-model"


def test_lone_surrogates_and_odd_unicode_pass(gw: Any) -> None:
    for text in ("\\ud800", "\\udfff\\ud800x", "\\u0000", "\\u2028\\ufeff"):
        raw = '{"max_tokens":5,"messages":[{"role":"user","content":"' + text + '"}]}'
        r = _post(gw, content=raw.encode())
        assert r.status_code == 200, (text, r.text)


def test_duplicate_keys_cannot_smuggle_a_model(tmp_path: Path) -> None:
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url) as gw,
    ):
        raw = (
            b'{"model":"a","model":"b","max_tokens":5,"max_tokens":9,'
            b'"messages":[{"role":"user","content":"q"}]}'
        )
        assert _post(gw, content=raw).status_code == 200
        body = up.requests()[0]["body"]
        assert body["model"] == "test-model" and body["max_tokens"] == 9


def test_max_tokens_beyond_budget_clamped_not_refused(tmp_path: Path) -> None:
    """Issue 13 item 3: a max_tokens over what is left is lowered to fit and forwarded."""
    thinking = {
        **MSG,
        "max_tokens": 100_000,
        "thinking": {"type": "enabled", "budget_tokens": 60_000},
    }
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, budget=5_000) as gw,
    ):
        assert _post(gw, {**MSG, "max_tokens": 100_000}).status_code == 200
        assert _post(gw, thinking).status_code == 200
        sent = [r["body"] for r in up.requests()]
        u = gw.usage()
    first, second = sent
    assert 2048 <= second["max_tokens"] < first["max_tokens"] < 5_000
    assert second["thinking"]["budget_tokens"] == second["max_tokens"] - 1
    assert u.clamped == 2 and u.refusals == {} and u.weighted_total <= 5_000


def test_max_tokens_refused_when_too_little_is_left(tmp_path: Path) -> None:
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, budget=2_500) as gw,
    ):
        r = _post(gw, {**MSG, "max_tokens": 100_000})
        _is_error(r, 403, "permission_error")
        assert "exhausted" in r.json()["error"]["message"]
        assert up.requests() == []
        assert _post(gw).status_code == 200  # a request that fits still goes through
        u = gw.usage()
        assert u.refusals == {"over_budget": 1} and u.weighted_total == 18


def test_exhausted_budget_refuses_everything(tmp_path: Path) -> None:
    # Cache-heavy answers: 1.25 x creation and 0.1 x read are charged.
    script = {
        "main": "all",
        "turns": [
            {"text": "a", "usage": {"input_tokens": 10, "output_tokens": 10,
                                    "cache_creation_input_tokens": 2000}},
            {"text": "b", "usage": {"input_tokens": 10, "output_tokens": 10,
                                    "cache_read_input_tokens": 20000}},
        ],
    }  # fmt: skip
    with running_gateway(tmp_path, script=script, budget=4_300) as gw:
        body = {**MSG, "messages": [{"role": "user", "content": "q"}]}
        assert _post(gw, body).status_code == 200  # 2520 charged
        follow = [*body["messages"], {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "q"}]  # fmt: skip
        assert _post(gw, {**body, "messages": follow}).status_code == 200  # +2020
        u = gw.usage()
        assert u.weighted_total == pytest.approx(2520 + 2020) and u.exhausted
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = _post(gw, body, path=path)
            _is_error(r, 403, "permission_error")
            assert "exhausted" in r.json()["error"]["message"]
        assert gw.usage().refusals == {"budget_exhausted": 2}


def test_concurrency_cap(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [{"text": "slow", "delay": 0.5}]}
    with running_gateway(tmp_path, script=script, max_concurrency=2) as gw:

        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(
                    *[c.post(gw.url + "/v1/messages", json=MSG, headers=gw.auth())
                      for _ in range(6)]
                )  # fmt: skip

        codes = sorted(r.status_code for r in asyncio.run(go()))
        assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
        assert set(codes) <= {200, 429}
        assert gw.usage().refusals["concurrency"] == codes.count(429)


def test_upstream_down_is_a_clean_502(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with running_gateway(tmp_path, upstream=f"http://127.0.0.1:{port}") as gw:
        _is_error(_post(gw), 502, "api_error")
        u = gw.usage()
        assert u.reserved == 0 and u.weighted_total == 0 and u.upstream_errors == 1


def test_upstream_breaking_off_mid_stream_billed_and_signalled(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [{"text": "y" * 500, "truncate_after": 4}]}
    with running_gateway(tmp_path, script=script) as gw:
        r = _post(gw, {**MSG, "stream": True, "max_tokens": 300})
        assert r.status_code == 200
        assert r.text.rstrip().endswith('"message": "upstream stream ended before message_stop"}}')
        u = gw.usage()
        assert u.output == 300 and u.reserved == 0  # no final usage seen: max_tokens charged


#: The two budgets (issue 27 item 4): tokens, and dollars at the entry's prices. A price
#: of $1 per million tokens makes one token cost one micro-dollar.
PRICED = {"input": 1.0, "output": 1.0, "cache_write": 1.25, "cache_read": 0.1}


def _budget_kw(kind: str, tokens: int) -> dict[str, Any]:
    if kind == "tokens":
        return {"budget": tokens}
    from agentbox.gateway._price import Price

    return {"budget": 10**9, "budget_usd": tokens / 1e6,
            "entry": replay_entry(price=Price(**PRICED))}  # fmt: skip


def _spent(u: Any, kind: str) -> float:
    return u.weighted_total if kind == "tokens" else round(u.cost_usd * 1e6, 6)


@pytest.mark.parametrize("kind", ["tokens", "usd"])
def test_500_concurrent_requests_never_overdraw(tmp_path: Path, kind: str) -> None:
    script = {
        "main": "all",
        "turns": [{"text": "ok", "delay": 0.05, "usage": {"input_tokens": 100,
                                                           "output_tokens": 50}}],
    }  # fmt: skip
    budget = 20_000
    with running_gateway(
        tmp_path, script=script, max_concurrency=1000, max_connections=1000,
        **_budget_kw(kind, budget),
    ) as gw:  # fmt: skip

        async def go() -> list[int]:
            limits = httpx.Limits(max_connections=500)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                rs = await asyncio.gather(
                    *[c.post(gw.url + "/v1/messages", json={**MSG, "max_tokens": 50},
                             headers=gw.auth()) for _ in range(500)],
                )  # fmt: skip
                return [r.status_code for r in rs]

        codes = asyncio.run(go())
        u = gw.usage()
        granted = codes.count(200)
        assert set(codes) <= {200, 403}
        assert granted * 150 == _spent(u, kind) <= budget
        assert granted >= 20 and codes.count(403) > 0
        assert u.reserved == 0 and u.reserved_usd == 0 and u.requests == 500
        assert sum(u.refusals.values()) == 500 - granted


@pytest.mark.parametrize("kind", ["tokens", "usd"])
def test_dropped_streams_are_billed(tmp_path: Path, kind: str) -> None:
    script = {
        "main": "all",
        "chunk_size": 5,
        "turns": [{"text": "z" * 400, "chunk_delay": 0.005,
                   "usage": {"input_tokens": 77, "output_tokens": 90}}],
    }  # fmt: skip
    rnd = random.Random(1234)
    with running_gateway(tmp_path, script=script, **_budget_kw(kind, 1_000_000)) as gw:

        async def drop(c: httpx.AsyncClient, after: int) -> None:
            body = {**MSG, "stream": True, "max_tokens": 200}
            async with c.stream("POST", gw.url + "/v1/messages", json=body,
                                headers=gw.auth()) as r:  # fmt: skip
                got = 0
                async for chunk in r.aiter_raw():
                    got += len(chunk)
                    if got >= after:
                        break  # hang up mid-stream

        async def go() -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                await asyncio.gather(*[drop(c, rnd.randint(400, 4000)) for _ in range(12)])

        asyncio.run(go())
        u = gw.usage()  # waits until every handler, the dropped ones too, has finished
        assert u.reserved == 0
        assert u.dropped_streams == 12 and u.requests == 12
        # Input known from message_start; output: the worst case (max_tokens), never less.
        assert (u.input, u.output) == (12 * 77, 12 * 200)
        if kind == "usd":
            assert u.reserved_usd == 0 and _spent(u, kind) == 12 * (77 + 200)


def test_unix_socket_mode_and_listen_policy(tmp_path: Path) -> None:
    with running_gateway(tmp_path, unix=True) as gw:
        mode = stat.S_IMODE(Path(gw.uds).stat().st_mode)
        assert mode & 0o007 == 0 and mode <= 0o660
        with httpx.Client(transport=httpx.HTTPTransport(uds=gw.uds)) as c:
            assert c.post("http://x/v1/messages", json=MSG, headers=gw.auth()).status_code == 200
    for bad in ("tcp:0.0.0.0:8080", "tcp:10.1.2.3:80", "tcp:[::]:80", "tcp:example.com:80"):
        with pytest.raises(PolicyRefused):
            parse_listen(bad)
    for bad in ("tcp:127.0.0.1", "http://127.0.0.1:80", "unix:", "tcp:127.0.0.1:99999"):
        with pytest.raises(ConfigError):
            parse_listen(bad)
    assert parse_listen("tcp:[::1]:80").host == "::1"


def test_raw_framing_tricks_reach_upstream_only_as_clean_requests(tmp_path: Path) -> None:
    body = json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}]})
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url) as gw,
    ):
        head = f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {gw.token}\r\n"
        head += "connection: close\r\n"  # so each answer ends with EOF
        cases = [
            # Content-Length and Transfer-Encoding together (the parser takes chunked).
            head + f"content-length: {len(body)}\r\ntransfer-encoding: chunked\r\n\r\n"
            f"{len(body):x}\r\n{body}\r\n0\r\n\r\n",
            # Two different lengths: refused by the HTTP parser.
            head + f"content-length: {len(body)}\r\ncontent-length: 3\r\n\r\n{body}",
            # A second request hidden after the body: served (or not) as its own request.
            head + f"content-length: {len(body)}\r\n\r\n{body}"
            "POST /v1/complete HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
            # A NUL in a header value.
            head + f"x-evil: a\x00b\r\ncontent-length: {len(body)}\r\n\r\n{body}",
        ]
        port = int(gw.url.rsplit(":", 1)[1])
        for raw in cases:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(raw.encode())
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            statuses = [int(line[9:12]) for line in data.split(b"\r\n") if line[:5] == b"HTTP/"]
            assert statuses and set(statuses) <= {200, 400, 404}, (raw, data[:300])
        for rec in up.requests():
            assert rec["path"] == "/v1/messages" and rec["body"]["model"] == "test-model"
            assert {k.lower() for k, _ in rec["headers"]}.isdisjoint({"x-evil", "x-api-key"})
        assert len(up.requests()) <= 3
