"""An upstream request the gateway abandons (client gone, gateway stopping) closes its connection.

Before, a cancelled ``PlainPool`` exchange left the connection open until the garbage
collector found it (a ``ResourceWarning``; an upstream socket held per abandoned stream).
"""

from __future__ import annotations

import asyncio
import contextlib

from agentbox.gateway._plain import PlainPool


async def _abandoned_request_closes() -> bytes:
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # closed at the end (a handler's return closes nothing)
        await accepted.put(reader)  # never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = PlainPool(
        host="127.0.0.1", port=port, uds=None, host_header="upstream", prefix="",
        connect_timeout=5, read_timeout=30,
    )  # fmt: skip
    try:
        task = asyncio.create_task(pool.request("/v1/messages", [], b"{}"))
        upstream = await asyncio.wait_for(accepted.get(), 10)
        await asyncio.wait_for(upstream.readuntil(b"{}"), 10)  # the request arrived whole
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The upstream sees the connection end: EOF, not a wait until our read timeout.
        return await asyncio.wait_for(upstream.read(), 10)
    finally:
        await pool.aclose()
        for w in writers:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        server.close()
        await server.wait_closed()


def test_a_cancelled_request_closes_its_upstream_connection() -> None:
    assert asyncio.run(_abandoned_request_closes()) == b""
