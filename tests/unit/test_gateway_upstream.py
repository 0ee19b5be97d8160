"""The gateway's plain HTTP/1.1 upstream client against a raw server that misbehaves."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agentbox.errors import ConfigError, UpstreamConnectError, UpstreamError, UpstreamTimeout
from agentbox.gateway._plain import tls_context
from agentbox.gateway._upstream import PlainPool, make_pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await r.readexactly(length)


def _canned(*responses: bytes, close: bool = False) -> Handler:
    """A server answering each request on a connection with the next canned response."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            for resp in responses:
                await _read_request(r)
                w.write(resp)
                await w.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    return handle


async def _with_server(handler: Handler, body: Callable[[PlainPool], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = make_pool(f"http://127.0.0.1:{port}", None, connect_timeout=2, read_timeout=2)
    assert isinstance(pool, PlainPool)
    try:
        await body(pool)
    finally:
        await pool.aclose()
        await _closed(server)


async def _closed(server: asyncio.Server) -> None:
    """Close ``server`` and wait (5 s at most) until its connections are closed too.

    Python 3.11's ``wait_closed`` does not wait for them (3.12's does): a handler still
    closing its connection (or a TLS handshake the client refused) when ``asyncio.run``
    ends leaves its socket to the garbage collector, a ResourceWarning in a later test.
    """
    server.close()
    await server.wait_closed()
    for _ in range(500):
        if not getattr(server, "_active_count", 0):  # 3.11 has no public count
            break
        await asyncio.sleep(0.01)


async def _get(pool: PlainPool) -> tuple[int, bytes]:
    resp = await pool.request("/v1/messages", [("content-type", "application/json")], b"{}")
    try:
        return resp.status, b"".join([c async for c in resp.aiter_bytes()])
    finally:
        await resp.aclose()


def run(handler: Handler, body: Callable[[PlainPool], Awaitable[None]]) -> None:
    asyncio.run(_with_server(handler, body))


def test_content_length_chunked_and_keep_alive() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"
    )
    plain = b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\nrequest-id: r1\r\n\r\nhello"
    seen: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(1)
        await _canned(chunked, plain, chunked)(r, w)

    async def body(pool: PlainPool) -> None:
        assert await _get(pool) == (200, b"abcde")
        resp = await pool.request("/x", [], b"")
        assert resp.status == 201 and resp.header("request-id") == "r1"
        assert b"".join([c async for c in resp.aiter_bytes()]) == b"hello"
        await resp.aclose()
        assert await _get(pool) == (200, b"abcde")

    run(handler, body)
    assert len(seen) == 1  # one connection, kept alive for all three


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\ncontent-length: -3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0x10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-a: 1\r\n  folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nname : v\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"SMTP 220 hello\r\n\r\n",
        b"HTTP/1.1 20x OK\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
    ],
)
def test_ambiguous_or_malformed_heads_refused(response: bytes) -> None:
    async def body(pool: PlainPool) -> None:
        with pytest.raises(UpstreamError):
            await _get(pool)

    run(_canned(response), body)


@pytest.mark.parametrize(
    "chunks",
    [b"zz\r\nab\r\n0\r\n\r\n", b"3\r\nabcXY0\r\n\r\n", b"5\r\nab", b"3\r\nabc\r\n"],
)
def test_bad_chunking_is_an_error(chunks: bytes) -> None:
    response = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks

    async def body(pool: PlainPool) -> None:
        with pytest.raises(UpstreamError):
            await _get(pool)

    run(_canned(response, close=True), body)


def test_read_to_eof_and_connection_close_are_not_reused() -> None:
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        await _read_request(r)
        if len(conns) == 1:
            w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        else:
            w.write(b"HTTP/1.0 200 OK\r\n\r\nuntil eof")
        await w.drain()
        w.close()

    async def body(pool: PlainPool) -> None:
        assert await _get(pool) == (200, b"ok")
        assert await _get(pool) == (200, b"until eof")
        assert pool._idle == []

    run(handler, body)
    assert len(conns) == 2


def test_stale_keep_alive_connection_retried_once() -> None:
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx")
        await w.drain()
        w.close()  # closes the keep-alive connection the client will try to reuse

    async def body(pool: PlainPool) -> None:
        assert await _get(pool) == (200, b"x")
        await asyncio.sleep(0.05)
        assert await _get(pool) == (200, b"x")

    run(handler, body)
    assert len(conns) == 2


def test_timeouts_and_unreachable() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        try:
            await asyncio.wait_for(r.read(), 5)  # silent until the client hangs up
        finally:
            w.close()

    async def body(pool: PlainPool) -> None:
        pool.read_timeout = 0.2
        with pytest.raises(UpstreamTimeout):
            await _get(pool)

    run(silent, body)

    async def unreachable() -> None:
        pool = make_pool("http://127.0.0.1:1", None, connect_timeout=2, read_timeout=2)
        with pytest.raises(UpstreamConnectError):
            await pool.request("/", [], b"")

    asyncio.run(unreachable())


def test_partial_body_closes_the_connection() -> None:
    big = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"2\r\nab\r\n" * 50
        + b"0\r\n\r\n"
    )
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        await _canned(big, big)(r, w)

    async def body(pool: PlainPool) -> None:
        resp = await pool.request("/", [], b"")
        async for _ in resp.aiter_bytes():
            break  # a client that hung up: the rest is never read
        await resp.aclose()
        assert pool._idle == []  # not reusable: the next request opens a new connection
        assert (await _get(pool))[0] == 200

    run(handler, body)
    assert len(conns) == 2


def _tls_files(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """A fresh CA, and a server certificate it signed for ``name``: (ca.pem, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
             signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:  # fmt: skip
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            b = b.add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                              content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )  # fmt: skip
        else:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("test CA", ca_key, "test CA", ca_key, True)
    leaf = cert(name, key, "test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    (tmp / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp / "cert.pem").write_bytes(leaf.public_bytes(pem))
    (tmp / "key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"


def _tls_run(tmp: Path, cert_name: str, client_ctx: Callable[[Path], ssl.SSLContext]) -> list[int]:
    """Serve two chunked answers over TLS on 127.0.0.1 as ``cert_name``; a pool for
    ``https://localhost`` (its context from ``client_ctx(ca.pem)``) asks twice."""
    ca, cert, key = _tls_files(tmp, cert_name)
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        await _canned(chunked, chunked)(r, w)

    async def main() -> None:
        sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        sctx.load_cert_chain(cert, key)
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=sctx)
        port = server.sockets[0].getsockname()[1]
        pool = PlainPool(host="localhost", port=port, uds=None, host_header="localhost",
                         prefix="", connect_timeout=2, read_timeout=2,
                         ssl_context=client_ctx(ca))  # fmt: skip
        try:
            for _ in range(2):
                assert await _get(pool) == (200, b"abc")
        finally:
            await pool.aclose()
            await _closed(server)

    asyncio.run(main())
    return conns


def test_https_upstream_verified_and_kept_alive(tmp_path: Path) -> None:
    """TLS with the CA trusted: both answers, over one connection."""

    def trusting(ca: Path) -> ssl.SSLContext:
        ctx = tls_context()
        ctx.load_verify_locations(ca)
        return ctx

    assert _tls_run(tmp_path, "localhost", trusting) == [1]


@pytest.mark.parametrize("case", ["untrusted CA", "wrong host name"])
def test_https_upstream_refused_unless_verified(tmp_path: Path, case: str) -> None:
    """The default context (certifi's CA bundle) refuses a certificate of an unknown CA,
    and a trusted certificate for another name is refused too: UpstreamConnectError."""

    def client(ca: Path) -> ssl.SSLContext:
        ctx = tls_context()
        if case == "wrong host name":
            ctx.load_verify_locations(ca)
        return ctx

    name = "localhost" if case == "untrusted CA" else "upstream.example"
    with pytest.raises(UpstreamConnectError, match="certificate"):
        _tls_run(tmp_path, name, client)


def test_make_pool_https_is_tls_on_the_same_client() -> None:
    pool = make_pool("https://api.example.invalid/", None, connect_timeout=1, read_timeout=1)
    assert isinstance(pool, PlainPool) and pool.tls and pool.port == 443
    assert pool.host_header == "api.example.invalid"
    plain = make_pool("http://127.0.0.1:8080/x/", None, connect_timeout=1, read_timeout=1)
    assert isinstance(plain, PlainPool) and not plain.tls and plain.prefix == "/x"
    with pytest.raises(ConfigError):
        make_pool("ftp://example", None, connect_timeout=1, read_timeout=1)


def test_body_read_timeout() -> None:
    async def stalls(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        try:
            await asyncio.wait_for(r.read(), 5)  # silent until the client hangs up
        finally:
            w.close()

    async def body(pool: PlainPool) -> None:
        pool.read_timeout = 0.3
        resp = await pool.request("/", [], b"")
        got = []
        with pytest.raises(UpstreamTimeout):
            async for chunk in resp.aiter_bytes():
                got.append(chunk)
        assert got == [b"abc"]  # what came before the silence was passed on
        await resp.aclose()

    run(stalls, body)


def test_chunks_that_arrive_together_are_passed_on_together() -> None:
    """SSE events the upstream wrote in one go leave as one piece (one ``send`` downstream,
    not one per event), and a later chunk is not waited for before passing them on."""
    events = [b"event: e\ndata: %d\n\n" % i for i in range(5)]
    burst = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    later = b"event: e\ndata: last\n\n"
    go_on = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + burst)
        await w.drain()
        await go_on.wait()  # the client must have had the burst before this comes
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(later), later))
        await w.drain()
        w.close()

    async def body(pool: PlainPool) -> None:
        resp = await pool.request("/v1/messages", [], b"{}")
        pieces = []
        async for piece in resp.aiter_bytes():
            pieces.append(piece)
            go_on.set()
        await resp.aclose()
        assert pieces == [b"".join(events), later]

    run(handler, body)


def test_no_private_asyncio_api() -> None:
    """The plain pool frames with h11 on public StreamReader calls (issue 14: it peeked at
    ``StreamReader._buffer``, a CPython internal)."""
    import ast
    import inspect

    from agentbox.gateway import _plain, _upstream

    for module in (_plain, _upstream):
        tree = ast.parse(inspect.getsource(module))
        used = [
            node
            for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr == "_buffer")
            or (isinstance(node, ast.Constant) and node.value == "_buffer")
        ]
        assert used == [], module.__name__


@pytest.mark.parametrize(
    "extra", [b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx", b"garbage\r\n\r\n"]
)
def test_bytes_after_a_whole_answer_leave_it_whole_but_the_connection_unused(extra: bytes) -> None:
    """An upstream that sends more than its answer: the answer stands (llhttp read it
    whole), and the connection is not kept (what followed would be read as the next)."""
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        await _canned(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + extra,
                      b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno")(r, w)  # fmt: skip

    async def body(pool: PlainPool) -> None:
        for _ in range(2):
            # The extra bytes arrive with the answer, in the same read.
            assert await _get(pool) == (200, b"ok")
        assert pool._idle == []

    run(handler, body)
    assert len(conns) == 2


def test_a_header_value_loses_its_trailing_space_and_repeats_are_joined() -> None:
    response = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked \r\nrequest-id: a\r\n"
                b"request-id: b\r\n\r\n2\r\nhi\r\n0\r\n\r\n")  # fmt: skip

    async def body(pool: PlainPool) -> None:
        resp = await pool.request("/v1/messages", [], b"{}")
        assert resp.header("transfer-encoding") == "chunked"
        assert resp.header("request-id") == "a, b"
        assert b"".join([c async for c in resp.aiter_bytes()]) == b"hi"
        await resp.aclose()

    run(_canned(response), body)
