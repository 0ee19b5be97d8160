"""The gateway's HTTP clients for its upstream: a lean HTTP/1.1 pool and httpx for TLS.

Plain-HTTP upstreams (the replay model on a private unix socket, llama.cpp or
vLLM on 127.0.0.1) are where the gateway's own cost shows: there httpx's
transport alone costs ~0.7 ms of CPU per request (httpcore's pure-Python
state machine under an anyio layer), more than the rest of the gateway
together, which caps a gateway near 1,000 requests per CPU-second. So those
use :class:`PlainPool`, a minimal keep-alive HTTP/1.1 client on asyncio
streams that writes each request in one ``send`` and frames responses
strictly:

- a status line ``HTTP/1.x NNN``; header names without spaces, no obsolete
  line folding, at most 64 KiB of head;
- ``Transfer-Encoding: chunked`` (alone; together with ``Content-Length`` the
  response is refused: that ambiguity is how response smuggling starts) or a
  single all-digit ``Content-Length``, or read to EOF with the connection then
  discarded;
- a connection is reused only after its response was read to the end and
  neither side said ``Connection: close``.

``https://`` upstreams (the Anthropic API) go through httpx's transport with a
verifying TLS context: there network latency dwarfs CPU, and TLS is not
something to hand-roll. Both give the same small response interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from agentbox.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

__all__ = [
    "HttpxPool",
    "PlainPool",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "make_pool",
]

_MAX_HEAD = 64 << 10
_IDLE_EXPIRY = 4.0  # below the 5 s keep-alive most servers use: no reuse of a closing socket


_HEX = b"0123456789abcdefABCDEF"


def _buffered_chunk(r: asyncio.StreamReader) -> int:
    """Size of the next chunk if it is complete in ``r``'s buffer already, else 0.

    Peeks at StreamReader's buffer (a CPython implementation detail, checked for);
    without it each chunk would cost the gateway a ``send`` of its own.
    """
    buf = getattr(r, "_buffer", None)
    if not isinstance(buf, bytearray):
        return 0
    end = buf.find(b"\r\n", 0, 64)
    if end <= 0:
        return 0
    size_s = bytes(buf[:end]).split(b";", 1)[0].strip()
    if not size_s or len(size_s) > 15 or size_s.strip(_HEX):
        return 0
    size = int(size_s, 16)
    return size if size and len(buf) >= end + 2 + size + 2 else 0


class UpstreamResponse(Protocol):
    """What the gateway needs of an upstream response."""

    status: int

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (lower case), if present."""

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as it arrives (transfer coding removed)."""

    async def aclose(self) -> None:
        """Release the connection (closing it if the body was not read to the end)."""


class Pool(Protocol):
    """An upstream connection pool."""

    async def request(
        self, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """POST ``body`` to ``path``; the response head has arrived when this returns."""

    async def aclose(self) -> None:
        """Close every connection."""

    def prepare(self) -> None:
        """Read from disk now whatever the pool would read lazily (before a privilege drop)."""


# -- plain HTTP/1.1 ---------------------------------------------------------------------
@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    reused: bool = False

    def close(self) -> None:
        self.writer.close()


@dataclass
class _PlainResponse:
    status: int
    headers: dict[str, str]
    conn: _Conn
    pool: PlainPool
    keep_alive: bool
    chunked: bool
    length: int | None
    done: bool = False
    closed: bool = False
    _timeout: float = field(default=600.0)
    timed_out: bool = False
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
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._timeout - idle, self._watch)

    async def _read(self, coro: Awaitable[bytes]) -> bytes:
        if self._timer is None:
            self._last = time.monotonic()
            self._watch()
        try:
            data = await coro
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            if self.timed_out:
                raise UpstreamTimeout("upstream read timed out") from None
            raise UpstreamError(f"upstream connection broke: {type(exc).__name__}") from None
        self._last = time.monotonic()
        return data

    async def _chunk_size(self, r: asyncio.StreamReader) -> int:
        line = await self._read(r.readuntil(b"\r\n"))
        size_s = line[:-2].split(b";", 1)[0].strip()
        if not size_s or len(size_s) > 15 or size_s.strip(_HEX):
            raise UpstreamError("bad chunk size from upstream")
        return int(size_s, 16)

    async def _chunk_data(self, r: asyncio.StreamReader, size: int) -> bytes:
        data = await self._read(r.readexactly(size + 2))
        if data[-2:] != b"\r\n":
            raise UpstreamError("bad chunk framing from upstream")
        return data[:-2]

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        r = self.conn.reader
        if self.chunked:
            while True:
                size = await self._chunk_size(r)
                if size == 0:
                    while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":
                        pass  # trailers: ignored
                    break
                parts = [await self._chunk_data(r, size)]
                # Pass on, in one piece, the chunks that already arrived with this one;
                # never wait for more (no buffering: each byte goes out when it came in).
                while (size := _buffered_chunk(r)) > 0:
                    await self._chunk_size(r)  # already buffered: returns at once
                    parts.append(await self._chunk_data(r, size))
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        elif self.length is not None:
            left = self.length
            while left > 0:
                data = await self._read(r.read(min(left, 1 << 16)))
                if not data:
                    raise UpstreamError("upstream closed before the end of the body")
                left -= len(data)
                yield data
        else:
            while True:
                data = await self._read(r.read(1 << 16))
                if not data:
                    break
                yield data
            self.keep_alive = False
        self.done = True

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.done and self.keep_alive:
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
    ) -> None:
        self.host, self.port, self.uds = host, port, uds
        self.prefix = prefix
        self.host_header = host_header
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.uds is not None:
                    r, w = await asyncio.open_unix_connection(self.uds, limit=_MAX_HEAD)
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
                and (not conn.reader.at_eof())
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
        head = [f"POST {self.prefix}{path} HTTP/1.1", f"host: {self.host_header}"]
        head += [f"{k}: {v}" for k, v in headers]
        head.append(f"content-length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        conn = self._take()
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except _Stale:
                conn.close()  # the server closed it while idle: once more on a new one
        conn = await self._connect()
        try:
            return await self._exchange(conn, data)
        except _Stale:
            conn.close()
            raise UpstreamError("upstream closed the connection without answering") from None

    async def _exchange(self, conn: _Conn, data: bytes) -> UpstreamResponse:
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
        try:
            return self._parse(conn, raw)
        except UpstreamError:
            conn.close()
            raise

    def _parse(self, conn: _Conn, raw: bytes) -> _PlainResponse:
        lines = raw[:-4].split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if (
            len(status_line) < 2
            or status_line[0] not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(status_line[1]) != 3
            or not status_line[1].isdigit()
        ):
            raise UpstreamError("malformed status line from upstream")
        status = int(status_line[1])
        headers: dict[str, str] = {}
        lengths: list[bytes] = []
        codings: list[bytes] = []
        connection = b""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                raise UpstreamError("malformed header from upstream")
            lname = name.lower()
            value = value.strip()
            if lname == b"content-length":
                lengths.append(value)
            elif lname == b"transfer-encoding":
                codings.append(value.lower())
            elif lname == b"connection":
                connection += b"," + value.lower()
            headers[lname.decode("latin-1")] = value.decode("latin-1")
        if status < 200:
            raise UpstreamError(f"unexpected informational status {status} from upstream")
        keep_alive = status_line[0] == b"HTTP/1.1" and b"close" not in connection
        chunked = False
        length: int | None = None
        if codings:
            if lengths or codings != [b"chunked"]:
                raise UpstreamError("ambiguous response framing from upstream")
            chunked = True
        elif lengths:
            if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 15:
                raise UpstreamError("bad content-length from upstream")
            length = int(lengths[0])
        elif status in (204, 304):
            length = 0
        return _PlainResponse(
            status, headers, conn, self, keep_alive, chunked, length, _timeout=self.read_timeout
        )

    def prepare(self) -> None:
        """Nothing to load: plain HTTP reads no files."""

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


class _Stale(Exception):
    """A reused connection turned out closed before any answer: safe to retry once."""


# -- httpx for TLS upstreams ---------------------------------------------------------------
class _HttpxResponse:
    def __init__(self, resp: httpx.Response, pool: HttpxPool, t: httpx.AsyncHTTPTransport):
        self._resp, self._pool, self._t = resp, pool, t
        self.status = resp.status_code
        self._closed = False

    def header(self, name: str) -> str | None:
        value: str | None = self._resp.headers.get(name)
        return value

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            raise UpstreamTimeout("upstream read timed out") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream connection broke: {type(exc).__name__}") from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await self._resp.aclose()
            finally:
                self._pool._idle.append(self._t)


#: Modules httpx imports lazily on its first request (measured with httpx 0.28).
_FIRST_REQUEST_MODULES = (
    "concurrent.futures.thread",  # asyncio resolves names in its default executor
    "httpcore",
    "sniffio",
    "anyio",
    "anyio.lowlevel",
    "anyio.to_thread",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
    "anyio._backends._asyncio",
)


class HttpxPool:
    """httpx transports, one per connection (httpcore's pool scans every connection per
    request); no ``AsyncClient``: no cookies, no redirects, no proxy from the environment."""

    def __init__(self, *, base_url: str, connect_timeout: float, read_timeout: float) -> None:
        self.base_url = base_url
        self._timeouts = {"connect": connect_timeout, "read": read_timeout,
                          "write": 60.0, "pool": 60.0}  # fmt: skip
        self._ssl: ssl.SSLContext | None = None
        self._all: list[httpx.AsyncHTTPTransport] = []
        self._idle: list[httpx.AsyncHTTPTransport] = []

    def prepare(self) -> None:
        """Build the verifying SSL context now (it reads the CA bundle from disk), and
        import what httpx imports on its first request (httpcore, anyio's asyncio
        backend): a gateway that dropped its privileges may not read its own
        interpreter's files any more (a Python under ``/root``)."""
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        for name in _FIRST_REQUEST_MODULES:
            importlib.import_module(name)

    def _take(self) -> httpx.AsyncHTTPTransport:
        if self._idle:
            return self._idle.pop()
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # one verifying context: ~40 ms each
        t = httpx.AsyncHTTPTransport(
            verify=self._ssl,
            retries=0,
            trust_env=False,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self._all.append(t)
        return t

    async def request(
        self, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        req = httpx.Request("POST", self.base_url + path, headers=headers, content=body,
                            extensions={"timeout": self._timeouts})  # fmt: skip
        t = self._take()
        try:
            resp = await t.handle_async_request(req)
        except httpx.TimeoutException:
            self._idle.append(t)
            raise UpstreamTimeout("upstream timed out") from None
        except httpx.HTTPError as exc:
            self._idle.append(t)
            raise UpstreamConnectError(f"upstream unreachable: {type(exc).__name__}") from None
        return _HttpxResponse(resp, self, t)

    async def aclose(self) -> None:
        for t in self._all:
            with contextlib.suppress(Exception):
                await t.aclose()
        self._all.clear()
        self._idle.clear()


def make_pool(
    base_url: str, uds: str | None, *, connect_timeout: float, read_timeout: float
) -> Pool:
    """The pool for an upstream: plain HTTP/1.1 for ``http://`` and unix sockets, else httpx."""
    url = httpx.URL(base_url)
    if uds is not None or url.scheme == "http":
        port = url.port or 80
        host_header = url.host if url.port is None else f"{url.host}:{url.port}"
        return PlainPool(
            host=url.host,
            port=port,
            uds=uds,
            host_header=host_header,
            prefix=url.path.rstrip("/"),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
    return HttpxPool(base_url=base_url.rstrip("/"), connect_timeout=connect_timeout,
                     read_timeout=read_timeout)  # fmt: skip
