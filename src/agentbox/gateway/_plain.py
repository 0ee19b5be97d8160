"""The gateway's upstream client: keep-alive HTTP/1.1 on asyncio streams, parsed by llhttp.

Local upstreams (the replay model on a private socket, llama.cpp or vLLM on
127.0.0.1) are where the gateway's own cost shows: httpx's transport costs ~0.7 ms
of CPU per request there (httpcore's state machine under an anyio layer), more
than the rest of the gateway, and httpx, httpcore and anyio are ~6 MiB of memory
in every task's gateway. :class:`PlainPool` is asyncio streams plus a response
parser in C: ``httptools`` (llhttp, Node.js's HTTP parser, the one uvicorn uses
when it is installed). h11, which framed answers here before, cost a fifth of the
gateway's CPU per streamed request in pure Python (its events, state machine and
chunk reader, per chunk). This module writes the request (its head is ours: a
fixed method and path and allow-listed headers, each checked to be one printable
ASCII line), moves bytes and decides when a connection may be reused. ``https://``
upstreams (the Anthropic API) use the same client over the standard library's TLS
with the context httpx would build (:func:`tls_context`: certificate and host name
verified, the same CA bundle).

llhttp's strict mode refuses what h11 refused (a response with both
``Transfer-Encoding`` and ``Content-Length``, two different lengths, a malformed
length, a header name with a space before its colon, control characters in a value,
obsolete line folding, bad chunk framing); three checks of ours stay on top:

- a ``Transfer-Encoding`` other than exactly ``chunked`` is refused (llhttp would
  read ``gzip, chunked`` as chunked, or another coding as a body until close);
- an HTTP version other than 1.0 or 1.1 is refused;
- an informational (1xx) status is refused: the gateway never asks for one.

Chunks that reached the socket together are passed on together: each read takes
whatever the kernel has (up to 64 KiB), the parser yields every piece of body in it,
and they are joined into one, never waiting for more (no peeking at
``asyncio.StreamReader._buffer``, a CPython internal). A connection is reused only
after its response was read to the end, the parser says it may be kept alive, and
nothing followed the response on it.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httptools

from agentbox.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from agentbox.gateway._upstream import UpstreamResponse

_MAX_HEAD = 64 << 10
_READ = 1 << 16
_IDLE_EXPIRY = 4.0  # below the 5 s keep-alive most servers use: no reuse of a closing socket


def _line_ok(text: str) -> bool:
    """One header name, value or request target we may write: printable ASCII, no
    CR/LF/NUL, no leading or trailing space (h11 refused the same)."""
    return text.isascii() and text.isprintable() and text == text.strip(" ")


class _Answer:
    """One response as llhttp reports it (the parser's callbacks: C calls these)."""

    __slots__ = ("body", "ended", "headers", "messages")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.ended = False
        self.messages = 0

    def on_message_begin(self) -> None:
        self.messages += 1  # a second one: the upstream sent more than its answer

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.messages > 1:  # not the answer: ignored (and the connection not reused)
            return
        # llhttp keeps a value's trailing whitespace, which is not part of it (RFC 9110).
        key = name.decode("latin-1").lower()
        if key in self.headers:  # repeated: one value, comma-joined (RFC 9110 5.3)
            self.headers[key] += ", " + value.rstrip(b" \t").decode("latin-1")
        else:
            self.headers[key] = value.rstrip(b" \t").decode("latin-1")

    def on_body(self, body: bytes) -> None:
        if self.messages == 1:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.ended = True


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    reused: bool = False
    answer: _Answer = field(default_factory=_Answer)
    parser: httptools.HttpResponseParser | None = None
    keep_alive: bool = False

    def close(self) -> None:
        self.writer.close()

    def expect_answer(self) -> None:
        """A request went out: a new parser for its answer."""
        self.answer = _Answer()
        self.parser = httptools.HttpResponseParser(self.answer)
        self.keep_alive = False

    def feed(self, data: bytes) -> None:
        """Parse the next bytes of the answer; :class:`UpstreamError` if they are wrong."""
        assert self.parser is not None
        answer = self.answer
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if answer.ended:  # garbage after a whole answer: it stands, no reuse
                answer.messages = 2
                return
            raise UpstreamError(f"bad response framing from upstream: {exc}") from None
        except httptools.HttpParserUpgrade:
            raise UpstreamError("upstream switched protocols") from None

    @property
    def reusable(self) -> bool:
        a = self.answer
        return a.ended and a.messages == 1 and self.keep_alive


@dataclass
class _PlainResponse:
    status: int
    headers: dict[str, str]
    conn: _Conn
    pool: PlainPool
    done: bool = False
    closed: bool = False
    _timeout: float = 600.0
    timed_out: bool = False
    until_eof: bool = False
    """The body has neither a length nor chunks: it ends when the upstream closes."""
    _last: float = 0.0
    _timer: asyncio.TimerHandle | None = None

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def _watch(self) -> None:
        # One watchdog per response instead of a timeout per read (which cost ~15 % of
        # the gateway's CPU on streams): it re-arms itself while data keeps coming and
        # aborts the connection once the upstream has been silent for the read timeout.
        self._timer = None
        if self.closed or self.done:
            return
        idle = time.monotonic() - self._last
        if idle >= self._timeout:
            self.timed_out = True
            self.conn.writer.transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(self._timeout - idle, self._watch)

    async def _read(self, coro: Awaitable[bytes]) -> bytes:
        if self._timer is None:
            self._last = time.monotonic()
            self._watch()
        try:
            data = await coro
        except OSError as exc:
            if self.timed_out:
                raise UpstreamTimeout("upstream read timed out") from None
            raise UpstreamError(f"upstream connection broke: {type(exc).__name__}") from None
        if not data and self.timed_out:
            raise UpstreamTimeout("upstream read timed out")
        self._last = time.monotonic()
        return data

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        conn = self.conn
        reader = conn.reader
        answer = conn.answer
        until_eof = self.until_eof
        while True:
            parts = answer.body
            if parts:
                answer.body = []
                yield parts[0] if len(parts) == 1 else b"".join(parts)
            if answer.ended:
                # Only now: a consumer that stopped at the last piece did not read to
                # the end, and its connection is not reused.
                self.done = True
                return
            data = await self._read(reader.read(_READ))
            if not data:  # EOF: the end of a body framed by the connection's close only
                if until_eof:
                    self.done = True
                    return
                raise UpstreamError("upstream closed before the end of the body")
            conn.feed(data)

    def abort(self) -> None:
        if not self.done and not self.closed:
            self.conn.writer.transport.abort()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.done and self.conn.reusable:
            self.pool._give(self.conn)
        else:
            self.conn.close()


class PlainPool:
    """Keep-alive HTTP/1.1 connections to one plain-HTTP upstream (TCP or a unix socket)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        uds: str | None,
        host_header: str,
        prefix: str,
        connect_timeout: float,
        read_timeout: float,
        tls: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port, self.uds = host, port, uds
        self.prefix = prefix
        self.host_header = host_header
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.tls = tls or ssl_context is not None
        """Connect over TLS, verifying the upstream's certificate and name."""
        self._ssl = ssl_context
        self._idle: list[_Conn] = []

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = tls_context()
        return self._ssl

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.uds is not None:
                    r, w = await asyncio.open_unix_connection(self.uds, limit=_MAX_HEAD)
                elif self.tls:
                    r, w = await asyncio.open_connection(
                        self.host, self.port, limit=_MAX_HEAD,
                        ssl=self._context(), server_hostname=self.host,
                    )  # fmt: skip
                else:
                    r, w = await asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD)
        except TimeoutError:
            raise UpstreamTimeout("connecting to the upstream timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to the upstream: {exc}") from None
        return _Conn(r, w)

    def _take(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if (
                now - conn.idle_since < _IDLE_EXPIRY
                and not conn.writer.is_closing()
                and not conn.reader.at_eof()
            ):
                conn.reused = True
                return conn
            conn.close()
        return None

    def _give(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def request(
        self, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        conn = self._take()
        if conn is not None:
            try:
                return await self._exchange(conn, path, headers, body)
            except _Stale:
                conn.close()  # the server closed it while idle: once more on a new one
        conn = await self._connect()
        try:
            return await self._exchange(conn, path, headers, body)
        except _Stale:
            conn.close()
            raise UpstreamError("upstream closed the connection without answering") from None

    def _request_bytes(
        self, conn: _Conn, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> bytes:
        target = self.prefix + path
        lines = [f"POST {target} HTTP/1.1", f"host: {self.host_header}"]
        ok = _line_ok(target) and " " not in target and _line_ok(self.host_header)
        for name, value in headers:
            ok = ok and _line_ok(name) and ":" not in name and " " not in name and _line_ok(value)
            lines.append(f"{name}: {value}")
        if not ok or not target:
            conn.close()
            raise UpstreamError("request not writable as HTTP/1.1: a header or the target "
                                "is not one printable ASCII line")  # fmt: skip
        lines.append(f"content-length: {len(body)}\r\n\r\n")
        conn.expect_answer()
        return "\r\n".join(lines).encode("ascii") + body

    async def _exchange(
        self, conn: _Conn, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        data = self._request_bytes(conn, path, headers, body)
        try:
            conn.writer.write(data)
            async with asyncio.timeout(self.read_timeout):
                await conn.writer.drain()
                raw = await conn.reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            conn.close()
            raise UpstreamTimeout("upstream did not answer in time") from None
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _Stale from None
            conn.close()
            raise UpstreamError("upstream closed the connection mid-answer") from None
        except (asyncio.LimitOverrunError, ValueError):
            conn.close()
            raise UpstreamError("upstream response head too large") from None
        except OSError as exc:
            conn.close()
            if conn.reused:
                raise _Stale from None
            raise UpstreamError(f"upstream connection broke: {exc}") from None
        except BaseException:  # cancelled (the client left, the gateway stops): not reusable
            conn.close()
            raise
        try:
            return self._parse(conn, raw)
        except UpstreamError:
            conn.close()
            raise

    def _parse(self, conn: _Conn, raw: bytes) -> _PlainResponse:
        conn.feed(raw)
        parser, answer = conn.parser, conn.answer
        assert parser is not None
        status = parser.get_status_code()
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise UpstreamError("malformed response head from upstream (HTTP version)")
        if 100 <= status < 200:
            raise UpstreamError(f"unexpected informational status {status} from upstream")
        headers = answer.headers
        te = headers.get("transfer-encoding")
        if te is not None and te.strip(" \t").lower() != "chunked":
            raise UpstreamError(f"unsupported transfer coding from upstream: {te[:64]!r}")
        until_eof = te is None and "content-length" not in headers and not answer.ended
        # What llhttp's should_keep_alive() says while the head is current (it forgets once
        # the message is complete): 1.1 unless "close", 1.0 only with "keep-alive".
        tokens = {t.strip(" \t").lower() for t in headers.get("connection", "").split(",")}
        version = parser.get_http_version()
        conn.keep_alive = not until_eof and (
            "keep-alive" in tokens if version == "1.0" else "close" not in tokens
        )
        return _PlainResponse(status, headers, conn, self, _timeout=self.read_timeout,
                              until_eof=until_eof)  # fmt: skip

    def prepare(self) -> None:
        """Build the verifying TLS context now (it reads the CA bundle from disk), and
        import what the first connection would (name resolution runs in asyncio's
        default executor): a gateway that dropped its privileges may not read its own
        interpreter's files any more (a Python under ``/root``)."""
        import concurrent.futures.thread  # noqa: F401
        import encodings.idna  # noqa: F401  (a host name is encoded with it to resolve it)

        if self.tls:
            self._context()

    async def aclose(self) -> None:
        """Close the idle connections and wait (1 s at most) until they are closed: a TLS
        connection's socket closes only once its close_notify went out, and a loop
        closed before that leaves the socket to the garbage collector."""
        conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()
        for conn in conns:
            try:
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
            except (OSError, TimeoutError, ssl.SSLError):
                conn.writer.transport.abort()


def tls_context() -> ssl.SSLContext:
    """The verifying client context for ``https://`` upstreams: what httpx builds (the CA
    bundle from ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` if set, else certifi's; hostname
    checked; TLS 1.2 or later), offering HTTP/1.1 only by ALPN."""
    if os.environ.get("SSL_CERT_FILE"):
        ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    elif os.environ.get("SSL_CERT_DIR"):
        ctx = ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    else:
        import certifi

        ctx = ssl.create_default_context(cafile=certifi.where())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class _Stale(Exception):
    """A reused connection turned out closed before any answer: safe to retry once."""
