"""The egress proxy over a real unix socket, with a real asyncio client: what passes, what not.

Each refusal is checked three ways: the status and reason the client gets, the
upstream that never saw a connection (or the resolver never asked), and the log
line. Names resolve through a resolver the test controls (:mod:`egress_helpers`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentbox.egress import AllowRule, EgressLimits, EgressPolicy, summarize
from egress_helpers import Harness, Upstream, read_all


def _policy(port: int, *, ranges: tuple[str, ...] = (), trusted: bool = False,
            **limits: float) -> EgressPolicy:  # fmt: skip
    ports = {"tls_ports": frozenset({443, port}), "http_ports": frozenset({80, port})}
    rule = AllowRule(pattern="up.test", source="test", trusted=trusted, **ports)
    return EgressPolicy(rules=(rule,), trusted_ranges=ranges, limits=EgressLimits(**limits))


def _connect(host: str, port: int | str) -> bytes:
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


def test_allowed_connect_tunnels_to_the_checked_address(tmp_path: Path) -> None:
    async def body() -> None:
        async with (
            Upstream() as up,
            Harness(
                tmp_path, _policy(up.port, ranges=("127.0.0.0/8",)), {"up.test": ["127.0.0.1"]}
            ) as h,
        ):
            reply = await h.ask(_connect("up.test", up.port))
            assert reply.status == 200
            reply.writer.write(b"ping through the tunnel")
            await reply.writer.drain()
            assert await reply.reader.readexactly(23) == b"ping through the tunnel"
            reply.writer.close()
            await asyncio.sleep(0.2)
            assert up.accepted == 1 and h.resolved == ["up.test"]
        (rec,) = h.records()
        assert rec["decision"] == "allowed" and rec["rule"] == "test:up.test"
        assert rec["host"] == "up.test" and rec["port"] == up.port and rec["method"] == "CONNECT"
        assert rec["address"] == "127.0.0.1" and rec["status"] == 200
        assert rec["bytes_up"] == 23 and rec["bytes_down"] == 23
        assert rec["duration"] >= 0 and rec["time"].endswith("+00:00")

    asyncio.run(body())


def test_host_not_allowed(tmp_path: Path) -> None:
    async def body() -> None:
        async with Upstream() as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",)),
            {"up.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            get = f"GET http://other.test:{up.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            for req in (_connect("other.test", up.port), _connect("sub.up.test", up.port), get):
                reply = await h.ask(req)
                assert reply.status == 403 and reply.headers["x-agentbox-egress"] == "not-allowed"
                assert b"not in this task's allow-list" in reply.body
            assert up.accepted == 0 and h.resolved == []  # never even resolved
        recs = h.records()
        assert [r["rule"] for r in recs] == ["not-allowed"] * 3
        assert all(r["decision"] == "denied" and r["address"] is None for r in recs)

    asyncio.run(body())


@pytest.mark.parametrize(
    "target",
    ["127.0.0.1:443", "[::1]:443", "10.0.0.1:443", "169.254.169.254:443", "2130706433:443",
     "0x7f000001:443", "127.1:443"],
)  # fmt: skip
def test_ip_literals_are_refused(tmp_path: Path, target: str) -> None:
    async def body() -> None:
        async with Harness(tmp_path, _policy(443), {}) as h:
            reply = await h.ask(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert reply.status == 403 and reply.headers["x-agentbox-egress"] == "ip-literal"
            host = target.rsplit(":", 1)[0]
            reply = await h.ask(f"GET http://{host}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert reply.status == 403 and reply.headers["x-agentbox-egress"] == "ip-literal"
            assert h.resolved == []
        assert [r["rule"] for r in h.records()] == ["ip-literal", "ip-literal"]

    asyncio.run(body())


@pytest.mark.parametrize(
    ("addrs", "cls", "trusted"),
    [
        (["127.0.0.1"], "loopback", False),
        (["127.0.0.1"], "loopback", True),  # even a name from the host's own config
        (["::1"], "loopback", False),
        (["::ffff:127.0.0.1"], "loopback", False),
        (["10.1.2.3"], "private", False),
        (["192.168.7.7"], "private", False),
        (["169.254.169.254"], "metadata", True),
        (["fd00:ec2::254"], "metadata", False),
        (["100.64.0.9"], "cgnat", False),
        (["203.0.113.80"], "reserved", False),
        (["93.184.215.14", "127.0.0.1"], "loopback", False),  # one bad answer spoils all
    ],
)
def test_names_resolving_to_inner_addresses_are_refused(
    tmp_path: Path, addrs: list[str], cls: str, trusted: bool
) -> None:
    async def body() -> None:
        async with (
            Upstream() as up,
            Harness(tmp_path, _policy(up.port, trusted=trusted), {"up.test": addrs}) as h,
        ):
            reply = await h.ask(_connect("up.test", up.port))
            assert reply.status == 403, reply.body
            assert reply.headers["x-agentbox-egress"] == f"address:{cls}"
            assert f"({cls})".encode() in reply.body
            assert up.accepted == 0
        (rec,) = h.records()
        assert rec["decision"] == "denied" and rec["rule"] == f"address:{cls}"
        assert rec["address"] in addrs or rec["address"] == "::ffff:7f00:1"

    asyncio.run(body())


def test_registry_names_may_resolve_to_reserved_ranges(tmp_path: Path) -> None:
    """Company mirrors: a trusted name (the host's own client config) to a private address
    passes the address check (whether anything answers there depends on the network), another
    name is refused without a connection."""

    async def body() -> None:
        names = {"up.test": ["10.255.255.1"]}
        async with Harness(tmp_path, _policy(443, trusted=True, connect_timeout=0.5), names) as h:
            reply = await h.ask(_connect("up.test", 443))
            assert reply.status in (200, 502, 504)
            assert reply.headers.get("x-agentbox-egress", "connect") == "connect"
            reply.writer.close()
        (rec,) = h.records()
        assert rec["decision"] == "allowed" and rec["address"] == "10.255.255.1"
        async with Harness(tmp_path, _policy(443, trusted=False), names) as h2:
            reply = await h2.ask(_connect("up.test", 443))
            assert reply.status == 403 and reply.headers["x-agentbox-egress"] == "address:private"

    asyncio.run(body())


def test_connect_to_port_22_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        async with Harness(tmp_path, _policy(443), {"up.test": ["93.184.215.14"]}) as h:
            for port in (22, 80, 8443, 65535):
                reply = await h.ask(_connect("up.test", port))
                assert reply.status == 403 and reply.headers["x-agentbox-egress"] == "port"
                assert f"port {port} is not allowed".encode() in reply.body
            for bad in ("0", "65536", "-1", "22x", ""):
                reply = await h.ask(_connect("up.test", bad))
                assert reply.status == 400
            assert h.resolved == []

    asyncio.run(body())


@pytest.mark.parametrize(
    ("request_bytes", "status", "rule"),
    [
        (b"POST http://up.test/ HTTP/1.1\r\nHost: up.test\r\nContent-Length: 0\r\n\r\n", 405,
         "method"),
        (b"PUT http://up.test/ HTTP/1.1\r\nHost: up.test\r\n\r\n", 405, "method"),
        (b"DELETE http://up.test/ HTTP/1.1\r\nHost: up.test\r\n\r\n", 405, "method"),
        (b"OPTIONS * HTTP/1.1\r\nHost: up.test\r\n\r\n", 405, "method"),
        (b"GET / HTTP/1.1\r\nHost: up.test\r\n\r\n", 400, "malformed"),
        (b"GET https://up.test/ HTTP/1.1\r\nHost: up.test\r\n\r\n", 400, "malformed"),
        (b"GET http://user:pw@up.test/ HTTP/1.1\r\nHost: up.test\r\n\r\n", 400, "malformed"),
        (b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\nContent-Length: 3\r\n\r\nabc", 400,
         "body"),
        (b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"0\r\n\r\n", 400, "body"),
        (b"CONNECT up.test HTTP/1.1\r\nHost: up.test\r\n\r\n", 400, "malformed"),
        (b"GET http://up.test/ HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431,
         "header-size"),
        (b"GARBAGE\r\n\r\n", 400, "malformed"),
        (b"GET http://up.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "malformed"),
    ],
)  # fmt: skip
def test_malformed_and_other_methods(
    tmp_path: Path, request_bytes: bytes, status: int, rule: str
) -> None:
    async def body() -> None:
        async with Harness(tmp_path, _policy(443), {"up.test": ["93.184.215.14"]}) as h:
            reply = await h.ask(request_bytes)
            assert reply.status == status, reply.body
            assert reply.headers["x-agentbox-egress"] == rule
            assert h.resolved == []
        (rec,) = h.records()
        assert rec["decision"] == "denied" and rec["rule"] == rule and rec["status"] == status

    asyncio.run(body())


def test_slow_request_head_times_out(tmp_path: Path) -> None:
    async def body() -> None:
        async with Harness(tmp_path, _policy(443, header_timeout=0.5), {}) as h:
            reply = await h.ask(b"CONNECT up.test:443 HTTP/1.1\r\nHost: up")
            assert reply.status == 408 and reply.headers["x-agentbox-egress"] == "header-timeout"

    asyncio.run(body())


def test_byte_cap(tmp_path: Path) -> None:
    """A download past the task's cap is cut at the cap; later connections are refused."""

    async def body() -> None:
        cap = 100_000
        async with Upstream("blast", blast=1 << 20) as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",), max_bytes_down=cap),
            {"up.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            reply = await h.ask(_connect("up.test", up.port))
            assert reply.status == 200
            got = await read_all(reply)
            assert len(got) == cap
            again = await h.ask(_connect("up.test", up.port))
            assert again.status == 403 and again.headers["x-agentbox-egress"] == "byte-cap"
            assert up.accepted == 1
        first, second = h.records()
        assert first["end"] == "byte-cap" and first["bytes_down"] == cap
        assert second["decision"] == "denied" and second["rule"] == "byte-cap"

    asyncio.run(body())


def test_upload_cap(tmp_path: Path) -> None:
    async def body() -> None:
        async with Upstream() as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",), max_bytes_up=5000),
            {"up.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            reply = await h.ask(_connect("up.test", up.port))
            reply.writer.write(b"y" * 20000)
            await reply.writer.drain()
            echoed = await read_all(reply)
            assert len(echoed) <= 5000
        (rec,) = h.records()
        assert rec["end"] == "byte-cap" and rec["bytes_up"] == 5000

    asyncio.run(body())


def test_connection_cap_and_idle_timeout(tmp_path: Path) -> None:
    async def body() -> None:
        async with Upstream() as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",), max_connections=2,
                              idle_timeout=1.0),
            {"up.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            held = [await h.ask(_connect("up.test", up.port)) for _ in range(2)]
            assert [r.status for r in held] == [200, 200]
            third = await h.ask(_connect("up.test", up.port))
            assert third.status == 503 and third.headers["x-agentbox-egress"] == "connections"
            # Quiet tunnels are closed by the proxy once idle.
            for r in held:
                assert await read_all(r) == b""
        ends = sorted(r["end"] for r in h.records())
        assert ends == ["closed", "idle", "idle"]

    asyncio.run(body())


def test_connection_time_cap(tmp_path: Path) -> None:
    async def body() -> None:
        async with Upstream() as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",), max_connection_time=1.0),
            {"up.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            reply = await h.ask(_connect("up.test", up.port))
            for _ in range(40):  # busy, never idle: the time cap still ends it
                try:
                    reply.writer.write(b"z")
                    await reply.writer.drain()
                    await reply.reader.readexactly(1)
                except (OSError, asyncio.IncompleteReadError):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the tunnel outlived its time cap")
        (rec,) = h.records()
        assert rec["end"] == "time"

    asyncio.run(body())


def test_plain_get_is_forwarded_in_origin_form_without_proxy_headers(tmp_path: Path) -> None:
    async def body() -> None:
        async with (
            Upstream("http") as up,
            Harness(
                tmp_path, _policy(up.port, ranges=("127.0.0.0/8",)), {"up.test": ["127.0.0.1"]}
            ) as h,
        ):
            req = (
                f"GET http://up.test:{up.port}/simple/attrs/?x=1 HTTP/1.1\r\n"
                "Host: elsewhere.test\r\nProxy-Authorization: Basic c2VjcmV0\r\n"
                "Proxy-Connection: keep-alive\r\nConnection: keep-alive, X-Drop\r\n"
                "X-Drop: 1\r\nAccept: text/html\r\n\r\n"
                # A second request pipelined behind the first must never reach the upstream.
                f"POST http://up.test:{up.port}/upload HTTP/1.1\r\nHost: up.test\r\n"
                "Content-Length: 0\r\n\r\n"
            ).encode()
            reply = await h.ask(req)
            assert reply.status == 200
            assert await read_all(reply) == b"hello"
        (head,) = up.requests
        text = head.decode().lower()
        assert text.startswith("get /simple/attrs/?x=1 http/1.1\r\n")
        assert f"host: up.test:{up.port}\r\n" in text and "elsewhere" not in text
        assert "proxy-" not in text and "x-drop" not in text and "keep-alive" not in text
        assert "connection: close" in text and "accept: text/html" in text
        (rec,) = h.records()
        assert rec["method"] == "GET" and rec["decision"] == "allowed" and rec["bytes_down"] > 0

    asyncio.run(body())


def test_unknown_name_and_unreachable_upstream(tmp_path: Path) -> None:
    async def body() -> None:
        async with Harness(
            tmp_path, _policy(1, ranges=("127.0.0.0/8",)), {"up.test": ["127.0.0.1"]}
        ) as h:
            h.names.pop("up.test")
            reply = await h.ask(_connect("up.test", 443))
            assert reply.status == 502 and reply.headers["x-agentbox-egress"] == "resolve"
            h.names["up.test"] = ["127.0.0.1"]
            reply = await h.ask(_connect("up.test", 1))  # nothing listens on port 1
            assert reply.status == 502 and reply.headers["x-agentbox-egress"] == "connect"

    asyncio.run(body())


def test_log_summary(tmp_path: Path) -> None:
    async def body() -> None:
        async with Upstream() as up, Harness(
            tmp_path, _policy(up.port, ranges=("127.0.0.0/8",)),
            {"up.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"]},
        ) as h:  # fmt: skip
            for _ in range(2):
                reply = await h.ask(_connect("up.test", up.port))
                reply.writer.write(b"abc")
                await reply.writer.drain()
                await reply.reader.readexactly(3)
                reply.writer.close()
            await h.ask(_connect("evil.test", 443))
            await h.ask(_connect("up.test", 22))
            await asyncio.sleep(0.3)

    asyncio.run(body())
    log_path = tmp_path / "egress.log"
    with log_path.open("a") as fh:  # a log is read defensively
        fh.write('not json\n["a list"]\n{"host": 5, "decision": "allowed"}\n{"truncated": 3}\n')
    s = summarize(log_path)
    by = {x.host: x for x in s.hosts}
    assert by["up.test"].allowed == 2 and by["up.test"].denied == 1
    assert by["up.test"].bytes_up == 6 and by["up.test"].bytes_down == 6
    assert by["up.test"].denied_rules == ["port"]
    assert by["evil.test"].allowed == 0 and by["evil.test"].denied_rules == ["not-allowed"]
    assert (s.allowed, s.denied, s.unreadable, s.unlogged) == (2, 2, 3, 3)
    assert summarize(tmp_path / "missing.log").hosts == []


def test_log_is_capped(tmp_path: Path) -> None:
    async def body() -> None:
        async with Harness(tmp_path, _policy(443, max_log_bytes=4096), {}) as h:
            for _ in range(40):
                await h.ask(_connect("nope.test", 443))

    asyncio.run(body())
    text = (tmp_path / "egress.log").read_text()
    assert len(text) <= 4096
    s = summarize(tmp_path / "egress.log")
    assert s.denied + s.unlogged == 40 and s.unlogged > 0
