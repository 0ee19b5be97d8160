"""The upstream request head the gateway writes by hand (h11 parses the answer only),
against a real TCP server that records the bytes it received and answers twice on one
connection: the head is exactly what h11 wrote before, keep-alive reuse still works, and
a header that is not one printable ASCII line is refused before anything is sent."""

from __future__ import annotations

import asyncio

import pytest

from agentbox.errors import UpstreamError
from agentbox.gateway._upstream import make_pool

_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def _serve(received: list[bytes], conns: list[int]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))  # fmt: skip
                received.append(head + await reader.readexactly(length))
                writer.write(_ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _run(headers: list[tuple[str, str]]) -> tuple[list[bytes], list[bytes], int]:
    received: list[bytes] = []
    conns: list[int] = []
    server = await _serve(received, conns)
    port = server.sockets[0].getsockname()[1]
    pool = make_pool(f"http://127.0.0.1:{port}/base", None, connect_timeout=5, read_timeout=5)
    bodies = []
    try:
        for body in (b'{"a":1}', b""):
            resp = await pool.request("/v1/messages", headers, body)
            bodies.append(b"".join([c async for c in resp.aiter_bytes()]))
            await resp.aclose()
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
    return received, bodies, len(conns)


def test_head_written_by_hand_and_connection_reused() -> None:
    headers = [("content-type", "application/json"), ("x-api-key", "k-1")]
    received, bodies, conns = asyncio.run(_run(headers))
    port_part = received[0].split(b"host: ")[1].split(b"\r\n")[0]
    assert received[0] == (
        b"POST /base/v1/messages HTTP/1.1\r\nhost: " + port_part + b"\r\n"
        b"content-type: application/json\r\nx-api-key: k-1\r\ncontent-length: 7\r\n\r\n"
        b'{"a":1}'
    )
    assert received[1].endswith(b"content-length: 0\r\n\r\n")
    assert bodies == [b"{}", b"{}"]
    assert conns == 1  # h11 was told a request went out: the answer ended, the socket reused


@pytest.mark.parametrize(
    "value", ["a\r\nx-injected: 1", "a\nb", "nul\x00", "caf\u00e9", " lead", "tab\tin"]
)
def test_a_header_that_is_not_one_printable_line_is_refused(value: str) -> None:
    with pytest.raises(UpstreamError, match=r"not writable as HTTP/1\.1"):
        asyncio.run(_run([("x-api-key", value)]))
