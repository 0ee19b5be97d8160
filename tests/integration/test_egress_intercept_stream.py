"""Intercepted answers relayed without h11 (``Content-Length`` bodies): one tunnel carries
large bodies back to back, each whole and redacted; the byte cap still cuts one.

The upstream, its CA and the proxy are :mod:`test_egress_intercept`'s (a TLS server in a
network namespace, names through ``egress_hosts``).
"""

from __future__ import annotations

import http.client
import json
import os
import time

import pytest
from test_egress_intercept import RULES, SECRET, Env, _Conn, _get, env  # noqa: F401

from agentbox.egress import EgressPolicy, spawn_proxy
from agentbox.egress._policy import EgressLimits
from agentbox.gateway import gateway_identity

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, drop)")


def test_large_bodies_back_to_back_on_one_tunnel(env: Env) -> None:  # noqa: F811
    c = _Conn(env, "up.test")
    before = len(env.upstream())
    sizes = (5 << 20, 1, 3 << 20 | 12345)
    for n in sizes:
        r = c.ask(_get(f"/size?n={n}"))
        assert r.status == 200 and r.body == b"x" * n  # type: ignore[attr-defined]
    # A redacted body after a relayed one, then a small answer: the tunnel still frames.
    e = c.ask(_get("/echo"))
    assert e.status == 200 and SECRET.encode() not in e.body  # type: ignore[attr-defined]
    assert e.body.count(b"*" * len(SECRET)) == 3  # type: ignore[attr-defined]
    h = c.ask(_get("/headers"))
    assert h.status == 200 and json.loads(h.body)["Authorization"] != f"Bearer {SECRET}"  # type: ignore[attr-defined]
    c.close()
    seen = env.upstream()[before:]
    assert [s["path"] for s in seen] == [f"/size?n={n}" for n in sizes] + ["/echo", "/headers"]
    recs = [x for x in env.records() if x.get("path") == "/size?n=…"][-3:]
    assert [x["bytes_down"] for x in recs] == list(sizes)
    assert all(x["status"] == 200 and x["injected"] for x in recs)


def test_byte_cap_cuts_an_intercepted_download(env: Env) -> None:  # noqa: F811
    cap = 1 << 20
    policy = EgressPolicy.for_phase(env.settings, rules=RULES)
    policy = EgressPolicy(
        **{**policy.model_dump(), "limits": EgressLimits(max_bytes_down=cap).model_dump()}
    )
    sock, log = env.dir / "cap.sock", env.dir / "cap.log"
    with spawn_proxy(
        sock, policy, log, gateway_identity(env.settings), stderr_file=env.dir / "cap.stderr",
        secret_values={"UP_TOKEN": SECRET},
    ) as proxy:  # fmt: skip
        assert proxy.ca_cert is not None
        capped = Env(proxy, sock, log, env.upstream_log, proxy.ca_cert, env.dir, env.settings)
        c = _Conn(capped, "up.test")
        c.tls.sendall(_get("/size?n=4194304"))
        resp = http.client.HTTPResponse(c, method="GET")  # type: ignore[arg-type]
        resp.begin()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead) as cut:
            resp.read()
        assert len(cut.value.partial) <= cap
        c.close()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    last = [x for x in recs if x.get("path") == "/size?n=…"][-1]
    assert last["rule"] == "byte-cap" and last["bytes_down"] <= cap


def test_a_kept_upstream_closed_as_a_request_went_out_is_retried_once(env: Env) -> None:  # noqa: F811
    """The upstream reads the next request on a kept connection and closes it unanswered
    (its keep-alive timed out as the request went out): a GET is sent again on a new
    connection, once, and the client gets the answer, not a 502."""
    c = _Conn(env, "up.test")
    before = len(env.upstream())
    assert c.ask(_get("/then-drop")).status == 200
    r = c.ask(_get("/headers"))
    assert r.status == 200, r.body  # type: ignore[attr-defined]
    c.close()
    seen = env.upstream()[before:]
    assert [s.get("dropped", False) for s in seen] == [False, True, False], seen
    rec = env.record(lambda x: x.get("path") == "/headers" and x.get("retried"))
    assert rec["status"] == 200 and rec["injected"]


def test_a_post_is_never_sent_twice_and_a_closed_kept_upstream_is_not_reused(env: Env) -> None:  # noqa: F811
    """A request with a body is not retried (502 when its kept connection was dropped
    under it), and a kept connection the upstream has closed while idle is not used: the
    next request, a POST, goes out on a new one and is answered."""
    c = _Conn(env, "up.test")
    before = len(env.upstream())
    assert c.ask(_get("/then-drop")).status == 200
    post = b"POST /upload/x HTTP/1.1\r\nHost: up.test\r\nContent-Length: 5\r\n\r\nhello"
    r = c.ask(post, method="POST")
    assert r.status == 502, r.body  # type: ignore[attr-defined]
    c.close()
    seen = env.upstream()[before:]
    assert [s.get("dropped", False) for s in seen] == [False, True], seen
    # Closed by the upstream while idle: once the upstream's close has had time to
    # arrive (a bound, not a speed target), the next request takes a new connection.
    c = _Conn(env, "up.test")
    assert c.ask(_get("/then-close")).status == 200
    time.sleep(1.0)
    r = c.ask(post, method="POST")
    assert r.status == 200 and r.body == b"got 5", r.body  # type: ignore[attr-defined]
    c.close()
