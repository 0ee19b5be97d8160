"""Connection limits uvicorn lacks: a request read timeout and a per-server connection cap.

The server side parses requests with llhttp (``httptools``, uvicorn's C parser,
Node.js's HTTP parser, strict mode: it refuses a request with both
``Content-Length`` and ``Transfer-Encoding``, two lengths, control characters in a
header, bad chunking): h11 in pure Python was a fifth of the gateway's CPU per
streamed request. uvicorn's protocol starts no timer on a new connection, and
cancels its keep-alive timer on every byte received: a client that sends headers
slowly, or never finishes them, holds its connection forever; and llhttp bounds
no head's size.
A review measured 3,000 such connections all still open after 33 s; a
podman sandbox can connect to the gateway's mounted socket directly, around
the relay's 64-connection cap, with a nofile limit of 20,000.

:class:`GuardedHttpProtocol` adds, per connection:

- a **head bound**: a request line and headers over :data:`MAX_HEAD` get a 400 and
  the connection closes (h11 had one; llhttp has none);
- **no protocol upgrade**: a request asking for one gets one plain answer (llhttp
  stops at its head, so its body is not read: a 400 for an empty body) and its
  connection closes after it; nothing after the head is read as HTTP;
- a **header timeout**: from a connection's first byte (or its opening) until
  the request's headers are complete; past it the connection is closed;
- a **body timeout**: from the headers until the whole body has arrived (a
  trickled body would otherwise hold one of the gateway's concurrency slots);
- a **connection cap** per server: a connection over the cap is closed as soon
  as it is accepted, before a byte is read;
- **coalesced writes** (:class:`CoalescingTransport`): what the connection writes in
  one turn of the event loop leaves in one ``send()``. uvicorn writes a response's
  head, each body chunk and the chunked terminator separately, and on a loaded host
  each ``send()`` to a local peer was the gateway's largest cost (~40 % of its CPU
  per streamed request, most of it the kernel delivering to the reader).

Refusals are counted (``ConnLimits.counts``) and logged once per kind per
minute at most, never per connection: a flood must not fill the log either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agentbox.core.log import get_logger

log = get_logger(__name__)

#: Bytes of a request's line and headers (h11's limit was 16 KiB; a Claude Code request's
#: head is under 2 KiB). llhttp itself has none: past this the request gets a 400.
MAX_HEAD = 64 << 10


@dataclass
class ConnLimits:
    """Limits for every connection of one server, and what they refused."""

    header_timeout: float = 10.0
    body_timeout: float = 120.0
    max_connections: int = 128
    notify: Callable[[str], None] | None = None
    """Called with the reason of each refusal (the gateway counts it in its usage file)."""
    counts: dict[str, int] = field(default_factory=dict)
    _logged: dict[str, float] = field(default_factory=dict)

    def copy(self) -> ConnLimits:
        """The same limits with counts of their own (one per server)."""
        return ConnLimits(self.header_timeout, self.body_timeout, self.max_connections)

    def refused(self, why: str) -> None:
        """Count one refused connection (``connections``, ``header_timeout``, ``body_timeout``)."""
        self.counts[why] = self.counts.get(why, 0) + 1
        if self.notify is not None:
            self.notify(why)
        now = time.monotonic()
        if now - self._logged.get(why, -1e9) >= 60:
            self._logged[why] = now
            log.warning("connections closed by a limit", reason=why, total=self.counts[why])


class CoalescingTransport(asyncio.Transport):
    """A connection's transport whose writes of one event-loop turn go out together.

    A write is held until the end of the current turn (``call_soon``), never longer;
    ``close`` sends what is held first, ``abort`` drops it. Everything else is the
    real transport's (flow control included: it sees the bytes one turn later)."""

    __slots__ = ("_held", "_loop", "_real", "_scheduled")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._real = real
        self._loop = loop
        self._held: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._held:
            return
        held = self._held
        self._held = []
        if not self._real.is_closing():
            self._real.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._real.close()

    def abort(self) -> None:
        self._held = []
        self._real.abort()

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._real.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._real.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size() + sum(map(len, self._held))

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        return False


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools (llhttp) protocol with :class:`ConnLimits` (read from
    ``config.conn_limits``), a bound on a request's head, and no protocol upgrade."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._limits: ConnLimits = getattr(config, "conn_limits", None) or ConnLimits()
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        self._head_size = 0
        self._reading = ""
        """What the parser is in: "head", "body" or "" (between requests)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            self._limits.refused("connections")
            transport.abort()
            return
        # uvicorn's cycles write through self.transport (read when each one starts).
        self.transport = CoalescingTransport(transport, self.loop)
        self._arm("header_timeout", self._limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self.parser is None:  # lost, or refused above: nothing more is read
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # a callback's exception too (_HeadTooLarge)
            # uvicorn's own warning, as before (the gateway's log is capped: _logcap).
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self._disarm()
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            # Never switched to (ws="none"): the request is answered as a plain one (with
            # the body llhttp read, none: it stops at the head); what follows is not HTTP,
            # so nothing more is read and the connection closes after the answer.
            self._refuse_more()
            return
        # A deadline for what this read left incomplete, armed once it is known: a
        # request that came whole (the usual case) costs no timer at all.
        reading = self._reading
        if reading == "body":
            phase, delay = "body_timeout", self._limits.body_timeout
        elif reading == "head" or self.cycle is None or self.cycle.response_complete:
            # Part of a head, or bytes between requests (uvicorn's keep-alive timer was
            # just cancelled): the header deadline runs from the first of them.
            phase, delay = "header_timeout", self._limits.header_timeout
        else:
            return
        if self._phase != phase:  # a deadline already running is not moved
            self._arm(phase, delay)

    def _refuse_more(self) -> None:
        self.transport.pause_reading()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        elif not self.transport.is_closing():
            self.transport.close()

    # llhttp's callbacks (the parser calls the protocol's methods).
    def on_message_begin(self) -> None:
        self._head_size = 0
        self._reading = "head"
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > MAX_HEAD:
            raise _HeadTooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted with a line's overhead, so many empty headers count too.
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise _HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        # The head is complete; its body (if any) gets its deadline once data_received
        # knows it is not complete too.
        self._reading = "body"
        if self._phase == "header_timeout":
            self._disarm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = ""
        if self._phase == "body_timeout":
            self._disarm()

    def _arm(self, phase: str, delay: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = ""

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self._limits.refused(self._phase)
        # Closing makes a request still reading its body see a disconnect.
        self.transport.abort()


class _HeadTooLarge(Exception):
    """A request's head passed :data:`MAX_HEAD` (raised in a parser callback: the parser
    stops and reports an error)."""
