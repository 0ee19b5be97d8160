"""Request-level egress: TLS terminated for the hosts rules name, each request decided.

After ``CONNECT host:port`` to a host some :class:`~agentbox.egress.rules.NetworkRule`
names, the proxy answers ``200``, then speaks TLS to the sandbox itself with a leaf
certificate for ``host`` signed by the task's CA (:mod:`._tls`); the SNI the client
sends must be ``host``. ALPN offers only ``http/1.1``: HTTP/2 is refused (its preface
is not an HTTP/1.1 request). Each request in the tunnel, in turn (keep-alive):

- must be in origin form (``/path?query``; an absolute-form URL is refused, whatever
  host it names), with one ``Host`` header naming the tunnel's host (and port, if
  given), a canonical path (no dot segments, no encoded ``/``, ``.`` or ``%``) and no
  ``Upgrade``: else ``400``/``403``/``421``, and nothing is sent upstream;
- is matched against the phase's rules (:func:`~agentbox.egress.rules.match_rule`,
  first match): none matches: ``403`` naming the ``[[network.rule]]`` that would allow
  it; a deny rule: ``403`` with its message;
- is sent upstream over TLS verified against the host's trust store plus
  ``egress_upstream_ca``, hop-by-hop headers removed, and, when the rule injects, every
  header of the injected name the sandbox sent removed and the rule's header added
  (the secret expanded here, in memory);
- its answer is relayed with every occurrence of an injected secret value (and of each
  expanded header value) in headers and body replaced by ``*`` of the same length
  (bodies stay their length; an occurrence split across reads is still found), and the
  proxy never follows a redirect: a client that follows one to another host makes a
  new request that no rule for this host matches, so it carries nothing injected.

Limits of the redaction: only the literal bytes are found, not the secret encoded
(base64, URL-encoding, JSON escapes), compressed (``Content-Encoding: gzip``) or
transformed by the server; see ``docs/reference/egress.md``.

Every request is one JSON line in the egress log (method, host, path with query
values elided, status, bytes, the rule, ``injected`` yes/no, and for a refusal the
rule to paste); never a header value.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import h11

from agentbox.core.hostname import normalize_host
from agentbox.egress._pipe import CLIENT_HIGH_WATER
from agentbox.egress._request import HOP, REASONS, Attempt, _Closed, _Refuse, safe
from agentbox.egress.rules import (
    NetworkRule,
    canonical_path,
    expand,
    match_rule,
    suggest_rule,
)

if TYPE_CHECKING:
    from agentbox.egress._proxy import EgressProxy
    from agentbox.egress._tls import TaskCA

_CHUNK = 262144
#: Decrypted upstream bytes that may wait for the client before reading pauses.
_UP_HIGH_WATER = 2 << 20
_MIN_REDACT = 4
#: The client socket's send buffer: the kernel doubles it (capped by net.core.wmem_max),
#: so at most 1 MiB waits in the kernel per connection, besides the 1 MiB in asyncio's.
_CLIENT_SNDBUF = 1 << 19


class Redactor:
    """Replaces each of ``secrets`` by ``*`` of its length, across chunk boundaries."""

    def __init__(self, secrets: Iterable[bytes]) -> None:
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_REDACT}, key=len, reverse=True)
        # A value that contains another (``Bearer <secret>`` and ``<secret>``) occurs only
        # where the one it contains does: a body without the contained ones is scanned once.
        every = self._secrets
        self._probe = [s for s in every if not any(o != s and o in s for o in every)]
        self._keep = max((len(s) for s in self._secrets), default=1) - 1
        self._tail = b""
        self.hits = 0

    def _sub(self, data: bytes) -> bytes:
        if not any(p in data for p in self._probe):
            return data
        for s in self._secrets:
            if s in data:
                self.hits += data.count(s)
                data = data.replace(s, b"*" * len(s))
        return data

    def header(self, value: bytes) -> bytes:
        """One header value, redacted."""
        return self._sub(value)

    def feed(self, data: bytes) -> bytes:
        """The next body bytes; holds back the last ``len(longest)-1`` bytes."""
        if not self._secrets:
            return data
        buf = self._sub(self._tail + data)
        if len(buf) <= self._keep:
            self._tail = buf
            return b""
        cut = len(buf) - self._keep
        self._tail = buf[cut:]
        return buf[:cut]

    def feed_parts(self, data: bytes) -> tuple[bytes | memoryview, ...]:
        """:meth:`feed` as pieces: without an occurrence near or in ``data``, what was held
        back and a view of ``data`` (nothing of the chunk copied)."""
        keep, tail = self._keep, self._tail
        if not self._secrets:
            return (data,)
        if len(data) <= keep:
            return (self.feed(data),)
        # An occurrence is inside ``data`` or straddles the boundary (then it lies in
        # ``tail + data[:keep]``); one wholly in ``tail`` was replaced when it was fed.
        joint = tail + data[:keep]
        if any(p in data or p in joint for p in self._probe):
            return (self.feed(data),)
        cut = len(data) - keep
        self._tail = data[cut:]
        return (tail, memoryview(data)[:cut]) if tail else (memoryview(data)[:cut],)

    def flush(self) -> bytes:
        """What is held back, at the body's end."""
        out, self._tail = self._tail, b""
        return out


def log_path(target: str) -> str:
    """The path as logged: the query's values elided (``/a?x=…&y=…``), bounded."""
    path, sep, query = target.partition("?")
    if not sep:
        return safe(path, 300)
    # A bare item (no "=") may be a value itself (``?TOKEN``): elided whole.
    items = [kv.partition("=") for kv in query.split("&") if kv][:10]
    shown = [f"{safe(k, 40)}=…" if eq else "…" for k, eq, _ in items]
    return safe(path, 250) + "?" + "&".join(shown)


@dataclass
class _Req:
    """One intercepted request's log record."""

    method: str = "-"
    path: str = "-"
    status: int | None = None
    decision: str = "denied"
    rule: str = "-"
    reason: str = ""
    injected: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    suggest: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _Body:
    """A ``Content-Length`` answer body being relayed from :meth:`_Up.data_received`."""

    def __init__(self, remaining: int, emit: Callable[[bytes], None],
                 sink: asyncio.StreamWriter) -> None:  # fmt: skip
        self.remaining = remaining
        self.emit = emit
        self.sink = sink
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class _Up(asyncio.Protocol):
    """The upstream TLS connection of one tunnel (reused while both sides keep it alive).

    A protocol, not a stream reader: what TLS decrypted is handed to h11 as it came,
    without a stream buffer to grow and trim (that copy was a tenth of the proxy's CPU
    on a download). Reading pauses while more than :data:`_UP_HIGH_WATER` bytes wait.

    An answer's ``Content-Length`` body (nearly every byte of a download) skips h11 and
    the relaying task: :meth:`relay_body` hands each decrypted chunk, as it arrives, to
    the relay's ``emit`` (redaction, byte cap, the client's TLS), counting the length
    down; reading pauses while the client's transport holds more than
    :data:`CLIENT_HIGH_WATER`. A byte past the length (a server that sends more than it
    announced) ends the connection's reuse.
    """

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._paused = False
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._body: _Body | None = None
        self._sink_paused = False
        self._resume: asyncio.Task[None] | None = None
        #: More bytes came than the answer announced: never reuse this connection.
        self.overrun = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._body is not None:
            self._feed_body(data)
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _UP_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._end_body()
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._can_write.set()
        self._end_body()
        self._wake()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self, _n: int = 0) -> bytes:
        """The next bytes the upstream sent (as they came), or ``b""`` at its end."""
        while not self._chunks:
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        data = self._chunks.popleft()
        self._size -= len(data)
        if self._paused and self._size <= _UP_HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            if not self._sink_paused:
                self.transport.resume_reading()
        return data

    async def write(self, data: bytes) -> None:
        """Send ``data``; wait while the transport's buffer is over its high-water mark."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the upstream connection closed")
        self.transport.write(data)
        await self._can_write.wait()

    @property
    def stale(self) -> bool:
        """Closed by the upstream while kept idle (its keep-alive timed out), or sent bytes
        no request asked for: a kept connection in this state is not used again."""
        closing = self.transport is None or self.transport.is_closing()
        return self._eof or bool(self._chunks) or closing

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        if self.transport is not None:
            self.transport.abort()

    # -- a Content-Length body, straight from data_received --------------------------------

    async def relay_body(
        self, remaining: int, emit: Callable[[bytes], None], sink: asyncio.StreamWriter
    ) -> None:
        """Hand the next ``remaining`` bytes to ``emit`` as they come; raise what it raises,
        or :class:`h11.RemoteProtocolError` if the upstream ends first."""
        body = self._body = _Body(remaining, emit, sink)
        # What arrived before h11 saw the head's end is the body's start, in order.
        pending, self._chunks, self._size = self._chunks, deque(), 0
        while pending and self._body is body:
            self._feed_body(pending.popleft())
        if pending:  # the body ended inside what was already read: more than announced
            self.overrun = True
        if self._paused and self.transport is not None:
            self._paused = False
            if not self._sink_paused:
                self.transport.resume_reading()
        if self._body is body and self._eof:
            self._end_body()
        try:
            await body.done
        finally:
            if self._body is body:
                self._body = None

    def _feed_body(self, data: bytes) -> None:
        body = self._body
        assert body is not None
        if len(data) > body.remaining:
            self.overrun = True
            data = data[: body.remaining]
        body.remaining -= len(data)
        try:
            if body.sink.transport.is_closing():
                raise ConnectionResetError("the client closed")
            body.emit(data)
        except Exception as exc:  # a byte cap, the client gone: the relaying task raises it
            self._body = None
            if not body.done.done():
                body.done.set_exception(exc)
            self.close()
            return
        if body.remaining == 0:
            self._body = None
            body.done.set_result(None)
        if (
            not self._sink_paused
            and body.sink.transport.get_write_buffer_size() >= CLIENT_HIGH_WATER
            and self.transport is not None
        ):
            self._sink_paused = True
            self.transport.pause_reading()
            self._resume = asyncio.ensure_future(self._resume_after_drain(body.sink))

    async def _resume_after_drain(self, sink: asyncio.StreamWriter) -> None:
        try:
            await sink.drain()
        except (ConnectionError, OSError) as exc:
            body = self._body
            if body is not None and not body.done.done():
                self._body = None
                body.done.set_exception(exc)
            return
        self._sink_paused = False
        if self.transport is not None and not self.transport.is_closing() and not self._paused:
            self.transport.resume_reading()

    def _end_body(self) -> None:
        body, self._body = self._body, None
        if body is not None and not body.done.done():
            body.done.set_exception(h11.RemoteProtocolError("the upstream closed mid-body"))


class Interceptor:
    """What one proxy needs to decide requests: rules, the CA, secrets, the upstream check."""

    def __init__(
        self,
        rules: tuple[NetworkRule, ...],
        ca: TaskCA,
        upstream: ssl.SSLContext,
        secret_values: Mapping[str, str],
        phase: str,
    ) -> None:
        self.rules = rules
        self.ca = ca
        self.upstream = upstream
        self.phase = phase
        self._headers: dict[int, bytes] = {}
        redact: list[bytes] = [v.encode() for v in secret_values.values()]
        for i, rule in enumerate(rules):
            if rule.inject is None:
                continue
            value = expand(rule.inject.value, secret_values)
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"the header {rule.inject.header} of {rule.name} has a line break")
            self._headers[i] = value.encode()
            if rule.inject.secrets:
                redact.append(value.encode())
        self._redact = tuple(redact)

    def redactor(self) -> Redactor:
        """A fresh redactor for one answer."""
        return Redactor(self._redact)

    # -- the tunnel --------------------------------------------------------------------------

    async def serve(
        self,
        proxy: EgressProxy,
        att: Attempt,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        host: str,
        port: int,
        trusted: bool,
    ) -> None:
        """After ``CONNECT host:port``: TLS to the client, then its requests one by one."""
        while (event := conn.next_event()) is not h11.PAUSED:
            if not isinstance(event, h11.EndOfMessage):
                raise _Refuse(400, "body", "a CONNECT with a body")
        early, _closed = conn.trailing_data
        if early:
            raise _Refuse(400, "early-data", "TLS sent before the CONNECT was answered")
        writer.write(conn.send(h11.Response(status_code=200, headers=[],
                                            reason=b"Connection established")))  # fmt: skip
        att.status = 200
        ctx = self.ca.context_for(host)  # its SNI callback refuses any other name
        try:
            await asyncio.wait_for(writer.start_tls(ctx), proxy.limits.header_timeout)
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            att.decision = "denied"
            if "CALLBACK" in str(exc) or "UNRECOGNIZED_NAME" in str(exc):
                att.rule, att.reason = "sni-mismatch", f"the TLS name (SNI) is not {host}"
            else:
                att.rule, att.reason = "tls", f"TLS with the sandbox failed: {safe(repr(exc))}"
            att.end = "error"
            return
        # As the tunnel's relay does (_pipe): up to 1 MiB may wait for the client before
        # reading from the upstream pauses, so a download is read on while the client reads.
        writer.transport.set_write_buffer_limits(high=CLIENT_HIGH_WATER)
        # The kernel's share of that slack: with the default socket buffer (~200 KiB) the
        # sandbox side could take only a fifth of a MiB while the proxy waits for a CPU.
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _CLIENT_SNDBUF)
        att.rule = "rules"
        up: _Up | None = None
        try:
            srv = h11.Connection(
                h11.SERVER, max_incomplete_event_size=proxy.limits.max_header_bytes
            )
            while True:
                rec = _Req()
                try:
                    up, keep = await self._one(proxy, att, srv, reader, writer, host, port,
                                                trusted, up, rec)  # fmt: skip
                except _Closed:
                    if rec.method != "-":  # cut short after it began
                        rec.reason = rec.reason or "the connection ended mid-request"
                        self._log(proxy, att, host, port, rec)
                        att.requests += 1
                    break
                except _Refuse as ref:
                    rec.reason = ref.reason
                    if rec.rule == "-" or ref.rule in ("byte-cap", "upstream", "connect"):
                        rec.rule = ref.rule
                    if ref.status in (400, 403, 421, 431):
                        rec.decision = "denied"
                    keep = False
                    if rec.status is None:  # nothing of an answer sent yet
                        rec.status = ref.status
                        await _answer(writer, ref, rec.suggest)
                self._log(proxy, att, host, port, rec)
                att.requests += 1
                if not keep:
                    break
                srv.start_next_cycle()
        finally:
            if up is not None:
                up.close()
            att.end = "closed"

    async def _one(
        self,
        proxy: EgressProxy,
        att: Attempt,
        srv: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        host: str,
        port: int,
        trusted: bool,
        up: _Up | None,
        rec: _Req,
    ) -> tuple[_Up | None, bool]:
        """One request; returns the upstream to keep (or None) and whether to read another."""
        lim = proxy.limits
        timeout = lim.idle_timeout if srv.their_state is h11.IDLE else lim.header_timeout
        try:
            req = await asyncio.wait_for(_next(srv, reader), timeout)
        except TimeoutError:
            raise _Closed from None
        if not isinstance(req, h11.Request):
            raise _Closed
        rec.method = safe(req.method.decode("ascii", "replace"), 16)
        target = req.target.decode("ascii", "replace")
        rec.path = log_path(target)
        if not target.startswith("/"):
            raise _Refuse(400, "absolute-form",
                          "inside a tunnel a request names a path, not a URL")  # fmt: skip
        hosts = [v for n, v in req.headers if n == b"host"]
        authority = host if port == 443 else f"{host}:{port}"
        try:
            named = [normalize_host(h.decode("ascii").rsplit(":", 1)[0]) for h in hosts]
            ports = [h.decode("ascii").rpartition(":") for h in hosts]
        except (ValueError, UnicodeDecodeError):
            named, ports = [], []
        port_ok = all(not sep or p == str(port) for _h, sep, p in ports) if ports else False
        if len(hosts) != 1 or named != [host] or not port_ok:
            raise _Refuse(421, "host-mismatch", f"the Host header must name {authority}")
        if any(n == b"upgrade" for n, _ in req.headers) or any(
            n == b"connection" and b"upgrade" in v.lower() for n, v in req.headers
        ):
            raise _Refuse(
                403, "upgrade", "Upgrade (WebSocket, h2c) is not relayed to hosts with rules"
            )
        path, _, query = target.partition("?")
        if "#" in target or not canonical_path(path):
            raise _Refuse(400, "path", f"path {safe(path)!r} is not canonical")
        rule = match_rule(self.rules, host=host, method=rec.method, path=path,
                          phase=self.phase, query=query)  # fmt: skip
        if rule is None:
            rec.suggest = suggest_rule(host, rec.method, path)
            raise _Refuse(
                403, "no-rule", f"no [[network.rule]] allows {rec.method} {host}{safe(path)}"
            )
        rec.rule = rule.name
        if rule.deny:
            raise _Refuse(403, rule.name, rule.refuse_message or "refused by a rule")
        rec.decision = "allowed"
        # The request upstream: hop-by-hop headers and any value for the injected name dropped.
        drop = set(HOP) | {b"expect"}
        for name, value in req.headers:
            if name == b"connection":
                drop.update(t.strip().lower() for t in value.split(b","))
        inject = self._headers.get(self.rules.index(rule))
        if rule.inject is not None and inject is not None:
            drop.add(rule.inject.header.lower().encode())
        headers = [(b"host", authority.encode())]
        headers += [(n, v) for n, v in req.headers if n not in drop]
        framing = [(n, v) for n, v in req.headers if n in (b"content-length", b"transfer-encoding")]
        if any(n == b"transfer-encoding" for n, _ in framing):
            headers.append((b"transfer-encoding", b"chunked"))
        elif framing:
            headers.append(framing[0])
        if rule.inject is not None and inject is not None:
            headers.append((rule.inject.header.encode(), inject))
            rec.injected = True
        if up is not None and (up.conn.our_state is not h11.IDLE or up.stale):
            up.close()
            up = None
        fresh = up is None
        # A kept connection the upstream closed as this request went out (its keep-alive
        # timed out meanwhile) is retried once on a new one when nothing of an answer came
        # and the request can be sent again as it was: no body, an idempotent method.
        replay = not fresh and not framing and req.method in _IDEMPOTENT
        request = h11.Request(method=req.method, target=req.target, headers=headers)
        body_read = False  # the client's request, to its end: read once, whatever the tries
        while True:
            if up is None:
                up = await self._connect(proxy, att, host, port, trusted)
            try:
                data = up.conn.send(request)
            except h11.LocalProtocolError as exc:
                up.close()  # closed here: a refused request's connection is nobody's
                raise _Refuse(400, "malformed", f"bad request: {safe(str(exc))}") from None
            try:
                await self._send_up(proxy, att, up, data or b"", rec)
                if not body_read:
                    await self._relay_request_body(proxy, att, srv, up, reader, writer, rec)
                    body_read = True
                else:  # a replay: no body (see ``replay``), only its end
                    await self._send_up(
                        proxy, att, up, up.conn.send(h11.EndOfMessage()) or b"", rec
                    )
                await self._relay_answer(proxy, att, srv, up, writer, rec)
            except (OSError, h11.RemoteProtocolError, ssl.SSLError) as exc:
                up.close()
                if rec.status is None and replay and not fresh:
                    rec.extra["retried"] = "the kept upstream connection closed unanswered"
                    up, fresh = None, True
                    continue
                if rec.status is None:
                    why = "the upstream closed" if fresh else "the kept upstream connection closed"
                    raise _Refuse(502, "upstream", f"{why}: {safe(repr(exc))}") from None
                raise _Closed from None
            except (_Refuse, _Closed):  # the byte cap, a malformed body, the client gone
                up.close()
                raise
            break
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
        # IDLE both ways: a cycle h11 ended, or a fresh one after a body relayed without it.
        keep_up = up.conn.our_state is h11.IDLE and up.conn.their_state is h11.IDLE
        if not keep_up:
            up.close()
        keep = srv.our_state is h11.DONE and srv.their_state is h11.DONE
        return (up if keep_up else None), keep

    async def _relay_request_body(
        self,
        proxy: EgressProxy,
        att: Attempt,
        srv: h11.Connection,
        up: _Up,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rec: _Req,
    ) -> None:
        """The client's request body (``100 Continue`` first if it waits for one), then its end."""
        if srv.they_are_waiting_for_100_continue:
            writer.write(srv.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        while True:
            ev = await _next(srv, reader)
            if isinstance(ev, h11.Data):
                await self._send_up(proxy, att, up, up.conn.send(ev) or b"", rec)
            elif isinstance(ev, h11.EndOfMessage):
                await self._send_up(proxy, att, up, up.conn.send(h11.EndOfMessage()) or b"", rec)
                return
            else:
                raise _Refuse(400, "malformed", "the request's body ended early")

    async def _send_up(
        self, proxy: EgressProxy, att: Attempt, up: _Up, data: bytes, rec: _Req
    ) -> None:
        if not data:
            return
        if not proxy._take(att, "up", len(data)):
            raise _Refuse(403, "byte-cap", "this task's egress byte cap is used up")
        rec.bytes_up += len(data)
        await up.write(data)

    async def _relay_answer(
        self,
        proxy: EgressProxy,
        att: Attempt,
        srv: h11.Connection,
        up: _Up,
        writer: asyncio.StreamWriter,
        rec: _Req,
    ) -> None:
        red = self.redactor()
        while True:
            ev = await _next(up.conn, up)
            if isinstance(ev, h11.InformationalResponse):
                continue  # 100 Continue was already answered to the client
            if isinstance(ev, h11.Response):
                break
            raise h11.RemoteProtocolError("no response")
        rec.status = ev.status_code
        drop = set(HOP) - {b"content-length", b"transfer-encoding"}
        for name, value in ev.headers:
            if name == b"connection":
                drop.update(t.strip().lower() for t in value.split(b","))
        headers = [(n, red.header(v)) for n, v in ev.headers if n not in drop]
        if ev.status_code == 101:
            raise _Refuse(502, "upgrade", "the upstream switched protocols")
        writer.write(srv.send(h11.Response(status_code=ev.status_code, headers=headers,
                                           reason=ev.reason)) or b"")  # fmt: skip

        def send(*pieces: bytes | memoryview) -> None:
            n = sum(len(p) for p in pieces)
            if not n:
                return
            if not proxy._take(att, "down", n):
                raise _Refuse(403, "byte-cap", "this task's egress byte cap is used up")
            rec.bytes_down += n
            # The pieces as they are (no join): a content-length body passes uncopied.
            out: list[bytes | memoryview] = []
            for p in pieces:
                if len(p):
                    # h11 only counts a piece's length and hands it back: a view will do.
                    out += srv.send_with_data_passthrough(h11.Data(data=cast(bytes, p))) or ()
            writer.writelines(out)

        length = _body_length(ev, rec.method)
        seen = 0
        while True:
            if length is not None and (ev2 := up.conn.next_event()) is h11.NEED_DATA:
                # h11 has passed on what it held: the rest comes from the protocol itself.
                await up.relay_body(length - seen, lambda data: send(*red.feed_parts(data)), writer)
                send(red.flush())
                writer.write(srv.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                if _keep_alive(ev) and not up.overrun:
                    up.conn = h11.Connection(h11.CLIENT)  # h11 never saw the body: start anew
                break
            if length is None:
                ev2 = await _next(up.conn, up)
            if isinstance(ev2, h11.Data):
                seen += len(ev2.data)
                send(red.feed(ev2.data))
                if writer.transport.get_write_buffer_size() >= CLIENT_HIGH_WATER:
                    await writer.drain()
            elif isinstance(ev2, h11.EndOfMessage):
                send(red.flush())
                writer.write(srv.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                break
            elif isinstance(ev2, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the upstream closed")
            else:
                raise h11.RemoteProtocolError("unexpected event in the answer")
        if red.hits:
            rec.extra["redacted"] = red.hits

    async def _connect(
        self, proxy: EgressProxy, att: Attempt, host: str, port: int, trusted: bool
    ) -> _Up:
        addrs = await proxy._addresses(att, host, port, trusted=trusted)
        last: BaseException | None = None
        for addr in addrs:
            try:
                _t, up = await asyncio.wait_for(
                    asyncio.get_running_loop().create_connection(
                        _Up, str(addr), port, ssl=self.upstream, server_hostname=host
                    ),
                    proxy.limits.connect_timeout,
                )
            except ssl.SSLCertVerificationError as exc:
                raise _Refuse(
                    502, "upstream-tls", f"{host}'s certificate: {safe(exc.verify_message)}"
                ) from None
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                last = exc
                continue
            att.address = str(addr)
            return up
        status = 504 if isinstance(last, TimeoutError) else 502
        raise _Refuse(status, "connect", f"cannot connect to {host}: {safe(repr(last))}")

    def _log(self, proxy: EgressProxy, att: Attempt, host: str, port: int, rec: _Req) -> None:
        proxy._log.write(
            conn=att.conn,
            method=rec.method,
            host=host,
            port=port,
            path=rec.path,
            decision=rec.decision,
            rule=rec.rule,
            reason=rec.reason,
            address=att.address,
            status=rec.status,
            bytes_up=rec.bytes_up,
            bytes_down=rec.bytes_down,
            injected=rec.injected,
            **({"suggest": rec.suggest} if rec.suggest else {}),
            **rec.extra,
        )


#: Methods a client may send again on its own when no answer came (RFC 9110 9.2.2).
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})


def _body_length(resp: h11.Response, method: str) -> int | None:
    """The answer's body length when ``Content-Length`` frames it and it is not empty."""
    if method == "HEAD" or resp.status_code in (204, 304) or resp.status_code < 200:
        return None
    lengths = [v for n, v in resp.headers if n == b"content-length"]
    if len(lengths) != 1 or any(n == b"transfer-encoding" for n, _ in resp.headers):
        return None
    try:
        length = int(lengths[0])
    except ValueError:
        return None
    return length if length > 0 else None


def _keep_alive(resp: h11.Response) -> bool:
    """Whether the upstream may carry another request after this answer (as h11 decides:
    HTTP/1.1 and no ``Connection: close``; our requests never ask to close)."""
    if resp.http_version != b"1.1":
        return False
    for name, value in resp.headers:
        if name == b"connection" and b"close" in {t.strip().lower() for t in value.split(b",")}:
            return False
    return True


async def _next(conn: h11.Connection, reader: asyncio.StreamReader | _Up) -> Any:
    """The next h11 event of ``conn``, reading from ``reader`` as needed."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            if conn.our_role is h11.SERVER:
                status = 431 if exc.error_status_hint == 431 else 400
                raise _Refuse(status, "malformed", f"bad request: {safe(str(exc))}") from None
            raise
        if event is h11.NEED_DATA:
            data = await reader.read(_CHUNK)
            if not data and conn.our_role is h11.SERVER and conn.their_state is h11.IDLE:
                raise _Closed
            conn.receive_data(data)  # h11 bounds an incomplete head (max_incomplete_event_size)
            continue
        if event is h11.PAUSED:
            raise _Closed
        if isinstance(event, h11.ConnectionClosed):
            if conn.our_role is h11.SERVER:
                raise _Closed
            raise h11.RemoteProtocolError("the upstream closed")
        return event


async def _answer(writer: asyncio.StreamWriter, ref: _Refuse, suggest: str | None) -> None:
    text = f"agentbox egress proxy: {ref.reason}\n"
    if suggest:
        text += "To allow it, add to the Boxfile:\n" + suggest + "\n"
    body = text.encode()
    head = (
        f"HTTP/1.1 {ref.status} {REASONS.get(ref.status, 'Error')}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        f"X-Agentbox-Egress: {safe(ref.rule, 100)}\r\n\r\n"
    ).encode()
    with contextlib.suppress(OSError, asyncio.TimeoutError, RuntimeError):
        writer.write(head + body)
        await asyncio.wait_for(writer.drain(), 5.0)
