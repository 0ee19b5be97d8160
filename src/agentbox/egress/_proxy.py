"""The proxy's connection handling: h11 frames the request, the policy decides, bytes flow.

One connection carries one request. The head is parsed by h11 (strict HTTP/1.1
framing, size and time bounded), then:

- ``CONNECT host:port`` to an allowed name and a ``CONNECT`` port of its rule:
  answered ``200`` and tunnelled byte for byte (TLS stays end to end: the proxy
  sees no content);
- ``GET``/``HEAD`` in absolute form (``http://host[:port]/path``) with no body:
  re-sent upstream in origin form with hop-by-hop headers removed and
  ``Connection: close``, and the answer relayed; anything the client sends after
  its request is never forwarded (no smuggling a second request behind it);
- anything else: a 4xx naming the reason (``405`` method, ``400`` malformed,
  ``403`` not allowed, ``431`` head too large, ``408`` head too slow), and ``502``
  or ``504`` when an allowed name cannot be resolved or reached.

Names are resolved here, every address checked (:func:`._addr.check_address`), and
the connection made to one of exactly those addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
from typing import Any
from urllib.parse import urlsplit

import h11

from agentbox.core.log import get_logger
from agentbox.egress._addr import check_address, host_matches
from agentbox.egress._intercept import Interceptor
from agentbox.egress._pipe import Upstream
from agentbox.egress._policy import EgressPolicy, Verdict
from agentbox.egress._record import EgressLog
from agentbox.egress._request import (
    HOP,
    REASONS,
    Attempt,
    Resolver,
    _Closed,
    _Refuse,
    checked_host,
    safe,
    split_authority,
    system_resolver,
)

log = get_logger(__name__)

_CHUNK = 262144


class EgressProxy:
    """Serves one task's sandbox: ``await proxy.handle(reader, writer)`` per connection."""

    def __init__(
        self,
        policy: EgressPolicy,
        log_file: EgressLog,
        *,
        resolver: Resolver | None = None,
        interceptor: Interceptor | None = None,
    ) -> None:
        self.policy = policy
        self.interceptor = interceptor
        self.limits = policy.limits
        self._log = log_file
        self._resolve = resolver or system_resolver
        self._networks = policy.networks
        self._ids = itertools.count(1)
        self._open = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.bytes_up = 0
        self.bytes_down = 0

    async def aclose(self) -> None:
        """Cancel every connection in flight (each still logs its attempt)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection, start to end; never raises."""
        loop = asyncio.get_running_loop()
        att = Attempt(conn=next(self._ids), start=loop.time())
        att.last = att.start
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._open += 1
        try:
            if self._open > self.limits.max_connections:
                raise _Refuse(503, "connections", "too many connections through the proxy")
            await self._serve(att, reader, writer)
        except _Refuse as ref:
            att.status, att.rule, att.reason = ref.status, ref.rule, ref.reason
            att.address = ref.address or att.address
            await self._answer(writer, ref)
        except _Closed:
            att.end = "empty"
        except asyncio.CancelledError:
            att.end = "stopped"
        except Exception as exc:  # a bug must not end the proxy: log it, close this one
            log.warning("egress connection failed", conn=att.conn, error=repr(exc)[:300])
            att.end = "error"
        finally:
            self._open -= 1
            if task is not None:
                self._tasks.discard(task)
            # A connect-and-close is no attempt; a terminated tunnel logged its requests.
            if att.end != "empty" and not att.requests:
                self._log.write(
                    conn=att.conn,
                    method=att.method,
                    host=att.host,
                    port=att.port,
                    decision=att.decision,
                    rule=att.rule,
                    reason=att.reason,
                    address=att.address,
                    status=att.status,
                    bytes_up=att.bytes_up,
                    bytes_down=att.bytes_down,
                    duration=round(loop.time() - att.start, 3),
                    end=att.end,
                )
            if att.end in ("closed", "byte-cap"):
                # What is already buffered for the client still reaches it (a refusal's
                # body, the last bytes before the cap), for at most a few seconds.
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 5.0)
            writer.transport.abort()

    async def _answer(self, writer: asyncio.StreamWriter, ref: _Refuse) -> None:
        body = f"agentbox egress proxy: {ref.reason}\n".encode()
        head = (
            f"HTTP/1.1 {ref.status} {REASONS.get(ref.status, 'Error')}\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            f"X-Agentbox-Egress: {ref.rule}\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            writer.write(head + body)
            await asyncio.wait_for(writer.drain(), 5.0)

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[h11.Connection, h11.Request]:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        got = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = 431 if exc.error_status_hint == 431 else 400
                rule = "header-size" if status == 431 else "malformed"
                raise _Refuse(status, rule, f"bad request: {safe(str(exc))}") from None
            if event is h11.NEED_DATA:
                # h11 bounds only an incomplete head: a whole one that arrives at once is
                # bounded here, by never reading more than the cap allows.
                room = self.limits.max_header_bytes - got
                if room <= 0:
                    raise _Refuse(431, "header-size", "request head too large")
                data = await reader.read(min(_CHUNK, room + 1))
                if not data and not got:
                    raise _Closed  # a connect-and-close (a readiness probe): not an attempt
                if not data:
                    raise _Refuse(400, "malformed", "connection closed inside the request head")
                got += len(data)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                return conn, event
            raise _Refuse(400, "malformed", "no request")

    async def _serve(
        self, att: Attempt, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            conn, req = await asyncio.wait_for(self._read_head(reader), self.limits.header_timeout)
        except TimeoutError:
            raise _Refuse(408, "header-timeout", "request head not received in time") from None
        att.method = safe(req.method.decode("ascii", "replace"), 16)
        target = req.target.decode("ascii", "replace")
        if req.method == b"CONNECT":
            raw_host, att.port = split_authority(target)
            att.host = safe(raw_host)
            host = checked_host(raw_host)
            att.host = host
            icpt = self.interceptor
            if icpt is not None and any(host_matches(r.host, host) for r in icpt.rules):
                verdict = self._verdict(att, host, att.port, tls=True)
                await icpt.serve(self, att, conn, reader, writer, host, att.port, verdict.trusted)
                return
            upstream = await self._open_upstream(att, host, att.port, tls=True)
            await self._connect(att, conn, writer, reader, upstream)
        elif req.method in (b"GET", b"HEAD"):
            host, port, path = self._absolute(att, target)
            framing = [
                (n, v) for n, v in req.headers if n in (b"content-length", b"transfer-encoding")
            ]
            if any(n == b"transfer-encoding" or v != b"0" for n, v in framing):
                raise _Refuse(400, "body", f"a {att.method} with a body is not relayed")
            upstream = await self._open_upstream(att, host, port, tls=False)
            await self._forward(att, req, host, port, path, writer, upstream)
        else:
            raise _Refuse(
                405, "method", f"method {att.method} not allowed (CONNECT, GET and HEAD only)"
            )

    def _absolute(self, att: Attempt, target: str) -> tuple[str, int, str]:
        if not target.lower().startswith("http://"):
            raise _Refuse(
                400,
                "malformed",
                "use the absolute form http://host/path (and CONNECT for https)",
            )
        try:
            parts = urlsplit(target)
            port = parts.port or 80
        except ValueError:
            raise _Refuse(400, "malformed", f"bad URL {safe(target)!r}") from None
        if parts.username is not None or parts.password is not None or not parts.hostname:
            raise _Refuse(400, "malformed", "a URL with credentials or no host")
        att.host, att.port = safe(parts.hostname), port
        host = checked_host(parts.hostname)
        att.host = host
        path = parts.path or "/"
        return host, port, path + (f"?{parts.query}" if parts.query else "")

    def _verdict(self, att: Attempt, host: str, port: int, *, tls: bool) -> Verdict:
        verdict = self.policy.decide(host, port, tls=tls)
        if not verdict.allowed:
            if verdict.rule == "port":
                kind = "CONNECT" if tls else "plain HTTP"
                raise _Refuse(403, "port", f"port {port} is not allowed for {host} ({kind})")
            raise _Refuse(403, "not-allowed", f"{host} is not in this task's allow-list")
        lim = self.limits
        if self.bytes_down >= lim.max_bytes_down or self.bytes_up >= lim.max_bytes_up:
            raise _Refuse(403, "byte-cap", "this task's egress byte cap is used up")
        att.rule, att.decision = verdict.rule, "allowed"
        return verdict

    async def _addresses(self, att: Attempt, host: str, port: int, *, trusted: bool) -> list[Any]:
        """``host``'s addresses, each checked; the ``egress_hosts`` setting's if it names it
        (the host's own setting: its address is trusted as a registry's is)."""
        fixed = self.policy.hosts_map.get(host)
        if fixed is not None:
            addr = ipaddress.ip_address(fixed)
            # Trusted like a registry's name: private is fine, loopback or metadata never.
            why = check_address(addr, trusted_name=True, trusted_ranges=self._networks)
            if why is not None and self.policy.address_checks:
                raise _Refuse(403, f"address:{why}", f"{host} is set to {addr} ({why})",
                              address=str(addr))  # fmt: skip
            return [addr]
        timeout = self.limits.connect_timeout
        try:
            addrs = await asyncio.wait_for(self._resolve(host, port), timeout)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise _Refuse(502, "resolve", f"cannot resolve {host}: {safe(str(exc))}") from None
        if not addrs:
            raise _Refuse(502, "resolve", f"{host} has no address")
        parsed = []
        for a in addrs:
            try:
                addr = ipaddress.ip_address(a.split("%", 1)[0])
            except ValueError:
                raise _Refuse(502, "resolve", f"{host}: resolver gave {safe(a)!r}") from None
            if self.policy.address_checks:
                why = check_address(addr, trusted_name=trusted, trusted_ranges=self._networks)
                if why is not None:
                    att.decision = "denied"
                    raise _Refuse(
                        403,
                        f"address:{why}",
                        f"{host} resolves to {addr} ({why})",
                        address=str(addr),
                    )
            parsed.append(addr)
        return parsed

    async def _open_upstream(self, att: Attempt, host: str, port: int, *, tls: bool) -> Upstream:
        verdict = self._verdict(att, host, port, tls=tls)
        parsed = await self._addresses(att, host, port, trusted=verdict.trusted)
        timeout = self.limits.connect_timeout
        last: BaseException | None = None
        for addr in parsed:
            try:
                # The address checked, never the name again: no second resolution.
                loop = asyncio.get_running_loop()
                _, up = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: Upstream(lambda n: self._grant(att, "down", n)), str(addr), port
                    ),
                    timeout,
                )
            except (OSError, TimeoutError) as exc:
                last = exc
                continue
            att.address = str(addr)
            return up
        att.address = str(parsed[-1])
        status = 504 if isinstance(last, TimeoutError) else 502
        raise _Refuse(status, "connect", f"cannot connect to {host}: {safe(repr(last))}")

    async def _connect(
        self,
        att: Attempt,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        reader: asyncio.StreamReader,
        up: Upstream,
    ) -> None:
        try:
            while (event := conn.next_event()) is not h11.PAUSED:
                if not isinstance(event, h11.EndOfMessage):
                    raise _Refuse(400, "body", "a CONNECT with a body")
            writer.write(conn.send(h11.Response(status_code=200, headers=[],
                                                reason=b"Connection established")))  # fmt: skip
            att.status = 200
            up.attach(writer)
            early, _closed = conn.trailing_data
            if early:
                if not self._take(att, "up", len(early)):
                    att.end = "byte-cap"
                    return
                await up.write(early)
            att.end = await self._relay(att, reader, up)
        except h11.ProtocolError as exc:
            raise _Refuse(400, "malformed", f"bad request: {safe(str(exc))}") from None
        except (ConnectionError, OSError):
            att.end = "error"
        finally:
            up.close()

    async def _forward(
        self,
        att: Attempt,
        req: h11.Request,
        host: str,
        port: int,
        path: str,
        writer: asyncio.StreamWriter,
        up: Upstream,
    ) -> None:
        try:
            drop = set(HOP)
            for name, value in req.headers:
                if name == b"connection":
                    drop.update(t.strip().lower() for t in value.split(b","))
            authority = host if port == 80 else f"{host}:{port}"
            headers = [(b"host", authority.encode())]
            headers += [(n, v) for n, v in req.headers if n not in drop]
            headers.append((b"connection", b"close"))
            client = h11.Connection(h11.CLIENT)
            out = client.send(h11.Request(method=req.method, target=path.encode(),
                                          headers=headers))  # fmt: skip
            out = (out or b"") + (client.send(h11.EndOfMessage()) or b"")
            if not self._take(att, "up", len(out)):
                att.end = "byte-cap"
                return
            up.attach(writer)
            await up.write(out)
            att.end = await self._relay(att, None, up)
        except (h11.ProtocolError, OSError) as exc:
            raise _Refuse(502, "upstream", f"relaying to {host}: {safe(repr(exc))}") from None
        finally:
            up.close()

    def _take(self, att: Attempt, way: str, n: int) -> bool:
        """Count ``n`` bytes one way against the task's cap; False once it is reached."""
        if way == "up":
            if self.bytes_up + n > self.limits.max_bytes_up:
                return False
            self.bytes_up += n
            att.bytes_up += n
        else:
            if self.bytes_down + n > self.limits.max_bytes_down:
                return False
            self.bytes_down += n
            att.bytes_down += n
        att.last = asyncio.get_running_loop().time()
        return True

    def _grant(self, att: Attempt, way: str, n: int) -> int:
        """Count up to ``n`` bytes one way against the task's cap; how many may pass."""
        if way == "up":
            n = max(0, min(n, self.limits.max_bytes_up - self.bytes_up))
            self.bytes_up += n
            att.bytes_up += n
        else:
            n = max(0, min(n, self.limits.max_bytes_down - self.bytes_down))
            self.bytes_down += n
            att.bytes_down += n
        if n:
            att.last = asyncio.get_running_loop().time()
        return n

    async def _pump_up(self, att: Attempt, src: asyncio.StreamReader, up: Upstream) -> str:
        """Client → upstream until EOF (then half-close) or the cap."""
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    up.write_eof()
                    return "eof"
                n = self._grant(att, "up", len(data))
                if n:
                    await up.write(data if n == len(data) else data[:n])
                if n < len(data):
                    return "byte-cap"
        except (ConnectionError, OSError):
            return "error"

    async def _watch(self, att: Attempt) -> str:
        loop = asyncio.get_running_loop()
        lim = self.limits
        tick = min(1.0, lim.idle_timeout / 4, lim.max_connection_time / 4)
        while True:
            now = loop.time()
            if now - att.start >= lim.max_connection_time:
                return "time"
            if now - att.last >= lim.idle_timeout:
                return "idle"
            await asyncio.sleep(tick)

    async def _relay(self, att: Attempt, reader: asyncio.StreamReader | None, up: Upstream) -> str:
        """Both directions (only the answer without ``reader``) until both end or a cap hits."""
        att.last = asyncio.get_running_loop().time()
        ways: set[asyncio.Future[str]] = {up.ended}
        if reader is not None:
            ways.add(asyncio.ensure_future(self._pump_up(att, reader, up)))
        dog = asyncio.ensure_future(self._watch(att))
        try:
            while ways:
                done, _ = await asyncio.wait(ways | {dog}, return_when=asyncio.FIRST_COMPLETED)
                if dog in done:
                    return dog.result()
                for fut in done:
                    ways.discard(fut)
                    if (result := fut.result()) != "eof":
                        return result
            return "closed"
        finally:
            for fut in (*ways, dog):
                fut.cancel()
            await asyncio.gather(*ways, dog, return_exceptions=True)
