"""The upstream side of a proxied connection, as an asyncio protocol.

What the upstream sends (nearly every byte of a download) goes from
``data_received`` straight into the client's transport: no stream buffer in
between, no coroutine switch per chunk. Measured in-process, the stream-reader
version spent most of its CPU time growing and trimming the reader's buffer.

Flow control both ways: when the client's transport holds more than its
high-water mark, reading from the upstream pauses until the client has drained
(``StreamWriter.drain``); :meth:`Upstream.write` waits while the upstream's own
transport is paused for writing. Every byte passes the task's byte cap first
(``grant``), which may cut a chunk short.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import cast

#: Bytes the client's transport may hold before the upstream is paused.
CLIENT_HIGH_WATER = 1 << 20
#: Bytes kept from the upstream before a client is attached (a server that speaks first).
_MAX_PENDING = 1 << 20


class Upstream(asyncio.Protocol):
    """One upstream connection; ``ended`` resolves with ``eof``, ``byte-cap`` or ``error``."""

    def __init__(self, grant: Callable[[int], int]) -> None:
        self._grant = grant
        self.transport: asyncio.Transport | None = None
        self._sink: asyncio.StreamWriter | None = None
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._paused = False
        self._resume: asyncio.Task[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._sink is None:
            self._pending.append(data)
            self._pending_size += len(data)
            if self._pending_size > _MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()
            return
        self._deliver(data)

    def eof_received(self) -> bool:
        if self._sink is not None and self._sink.can_write_eof():
            with contextlib.suppress(OSError):
                self._sink.write_eof()
        self._end("eof")
        return True  # keep the other direction open (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        self._end("error" if exc is not None else "eof")

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- used by the proxy -------------------------------------------------------------------

    def attach(self, sink: asyncio.StreamWriter) -> None:
        """From now on, deliver what the upstream sends to ``sink`` (the client)."""
        self._sink = sink
        sink.transport.set_write_buffer_limits(high=CLIENT_HIGH_WATER)
        pending, self._pending = self._pending, []
        for data in pending:
            self._deliver(data)
        if self.transport is not None and not self._paused and not self.transport.is_closing():
            self.transport.resume_reading()

    async def write(self, data: bytes) -> None:
        """Send ``data`` upstream; wait while the upstream's transport is full."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("upstream connection closed")
        self.transport.write(data)
        await self._can_write.wait()

    def write_eof(self) -> None:
        """Half-close towards the upstream (the client finished sending)."""
        if self.transport is not None and self.transport.can_write_eof():
            with contextlib.suppress(OSError):
                self.transport.write_eof()

    def close(self) -> None:
        """Drop the upstream connection at once; idempotent."""
        if self._resume is not None:
            self._resume.cancel()
        if self.transport is not None:
            self.transport.abort()
        self._end("error")

    # -- internals ---------------------------------------------------------------------------

    def _deliver(self, data: bytes) -> None:
        if self.ended.done() or self._sink is None:
            return
        n = self._grant(len(data))
        if n:
            self._sink.write(data if n == len(data) else data[:n])
        if n < len(data):
            self._end("byte-cap")
            return
        if not self._paused and self._sink.transport.get_write_buffer_size() >= CLIENT_HIGH_WATER:
            self._paused = True
            if self.transport is not None:
                self.transport.pause_reading()
            self._resume = asyncio.ensure_future(self._resume_after_drain())

    async def _resume_after_drain(self) -> None:
        assert self._sink is not None
        try:
            await self._sink.drain()
        except (ConnectionError, OSError):
            self._end("error")
            return
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _end(self, why: str) -> None:
        if not self.ended.done():
            self.ended.set_result(why)
