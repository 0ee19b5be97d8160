"""Property tests: whatever a sandbox sends the proxy, it answers (or closes) and keeps serving,
and it never resolves, let alone connects to, a name its policy does not allow.

One real proxy on a real unix socket per test; hypothesis drives raw and structured
requests at it; an upstream echo server counts what reaches it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentbox.egress import AllowRule, EgressLimits, EgressPolicy
from egress_helpers import Harness, Upstream

ANSWERS = {200, 400, 403, 405, 408, 431, 502, 503, 504}
ALLOWED = "up.test"


class Rig:
    """A loop that lives across examples, the proxy, and an upstream it may reach."""

    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.up = self.loop.run_until_complete(Upstream().__aenter__())
        rule = AllowRule(pattern=ALLOWED, source="test", tls_ports=frozenset({443, self.up.port}))
        limits = EgressLimits(header_timeout=0.5, max_header_bytes=4096, idle_timeout=2.0)
        policy = EgressPolicy(rules=(rule,), trusted_ranges=("127.0.0.0/8",), limits=limits)
        names = {ALLOWED: ["127.0.0.1"], "evil.test": ["127.0.0.1"], "inner.test": ["10.0.0.1"]}
        self.h = self.loop.run_until_complete(Harness(tmp, policy, names).__aenter__())

    def send(self, data: bytes) -> int | None:
        async def go() -> int | None:
            reply = await self.h.ask(data, eof=True, wait=5.0)
            reply.writer.close()
            return reply.status

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.h.__aexit__(None, None, None))
        self.loop.run_until_complete(self.up.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


def _still_serves(rig: Rig) -> None:
    status = rig.send(f"CONNECT {ALLOWED}:{rig.up.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 200


@FUZZ
@given(data=st.binary(max_size=600))
def test_raw_bytes(rig: Rig, data: bytes) -> None:
    status = rig.send(data)
    assert status is None or status in ANSWERS
    assert set(rig.h.resolved) <= {ALLOWED}


tokens = st.sampled_from(
    ["CONNECT", "GET", "HEAD", "POST", "connect", "get", "PRI", "CONNECT\x00", "", "G ET"]
)
hosts = st.one_of(
    st.sampled_from([ALLOWED, "UP.TEST", "up.test.", "evil.test", "inner.test", "x.up.test",
                     "127.0.0.1", "[::1]", "2130706433", "0x7f.1", "up.test\x00.evil.test",
                     "up.test@evil.test", "evil.test#up.test", "up%2etest", "", "[up.test]"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-_[]:@%", max_size=30),
)  # fmt: skip
ports = st.one_of(st.sampled_from(["443", "22", "0", "65536", "", "443 ", "+443", "0x1bb"]),
                  st.integers(min_value=-5, max_value=70000).map(str))  # fmt: skip
headers = st.lists(
    st.tuples(st.sampled_from(["Host", "Content-Length", "Transfer-Encoding", "Connection",
                               "Proxy-Authorization", "X-A", "Upgrade", "Expect"]),
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20)),
    max_size=5,
)  # fmt: skip


@FUZZ
@given(method=tokens, host=hosts, port=ports, hdrs=headers, absolute=st.booleans(),
       tail=st.binary(max_size=40))  # fmt: skip
def test_structured_requests(
    rig: Rig, method: str, host: str, port: str, hdrs: list[tuple[str, str]], absolute: bool,
    tail: bytes,
) -> None:  # fmt: skip
    if method.upper() == "CONNECT" or not absolute:
        target = f"{host}:{port}"
    else:
        target = f"http://{host}:{port}/p"
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs)
    before = rig.up.accepted
    status = rig.send(head.encode("utf-8", "surrogateescape") + b"\r\n" + tail)
    assert status is None or status in ANSWERS
    # Only the allowed name is ever resolved; a 200 is only ever a CONNECT to it on its port.
    assert set(rig.h.resolved) <= {ALLOWED}
    if status == 200:
        assert method == "CONNECT" and port.isdigit() and int(port) == rig.up.port
        assert host.lower().rstrip(".") == ALLOWED
    elif rig.up.accepted != before:
        # Reached the upstream without a 200: only a GET to the allowed name and port.
        assert method in ("GET", "HEAD") and host.lower().rstrip(".") == ALLOWED


def test_proxy_survives_the_fuzz(rig: Rig) -> None:
    for data in (b"\x00" * 100, b"CONNECT " + b"a" * 5000, b"\r\n" * 3000, b"GET \xff\xfe"):
        rig.send(data)
    _still_serves(rig)
