"""The gateway's client connections send what one event-loop turn wrote in one write
(issue 35 §5: each ``send()`` to a local peer was the largest cost of a streamed request)."""

from __future__ import annotations

import asyncio
import socket

from agentbox.gateway._conn import CoalescingTransport


class _Peer(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _pair() -> tuple[asyncio.Transport, _Peer, list[bytes]]:
    """A real socket transport whose writes are recorded, and the peer reading it."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    real, _ = await loop.connect_accepted_socket(asyncio.Protocol, a)
    _, peer = await loop.connect_accepted_socket(_Peer, b)
    writes: list[bytes] = []
    write = real.write

    def recorded(data: bytes) -> None:
        writes.append(bytes(data))
        write(data)

    real.write = recorded  # type: ignore[method-assign]
    return real, peer, writes


def test_one_turn_one_write_in_order() -> None:
    async def main() -> None:
        real, peer, writes = await _pair()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"5\r\nhello\r\n")
        t.write(b"")
        t.write(b"0\r\n\r\n")
        assert writes == []  # held until the end of this turn, not sent piece by piece
        await asyncio.sleep(0)
        assert writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
        t.write(b"next")  # a later turn: a write of its own, never held longer
        await asyncio.sleep(0)
        assert writes[1:] == [b"next"]
        t.close()
        await peer.closed
        assert peer.data == b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\nnext"

    asyncio.run(main())


def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    async def main() -> None:
        real, peer, _ = await _pair()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"last words")
        t.close()  # in the same turn: what was written goes out before the close
        await peer.closed
        assert peer.data == b"last words"
        assert t.is_closing()

        real2, peer2, writes2 = await _pair()
        t2 = CoalescingTransport(real2, asyncio.get_running_loop())
        t2.write(b"never sent")
        t2.abort()
        await peer2.closed
        await asyncio.sleep(0)
        assert writes2 == []
        assert peer2.data == b""

    asyncio.run(main())
