"""An in-process egress proxy on a real unix socket, a resolver the test controls, and upstreams.

The proxy is the real :class:`EgressProxy` serving a real socket; only the name
resolution is the test's (``names``: host -> addresses), so a name can be made to
resolve to loopback or a private address. Upstream servers listen on 127.0.0.1 and
count the connections they get, so "never connected" is checked, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from agentbox.egress import EgressPolicy
from agentbox.egress._proxy import EgressProxy
from agentbox.egress._record import EgressLog


class Upstream:
    """A TCP server on 127.0.0.1: ``echo`` (default), ``blast`` N bytes, or ``http``."""

    def __init__(self, mode: str = "echo", *, blast: int = 0) -> None:
        self.mode, self.blast = mode, blast
        self.accepted = 0
        self.requests: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            if self.mode == "echo":
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            elif self.mode == "blast":
                chunk = b"x" * 65536
                left = self.blast
                while left > 0:
                    w.write(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))
                    await w.drain()
            else:
                head = await r.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                more = b""
                with contextlib.suppress(TimeoutError):
                    more = await asyncio.wait_for(r.read(65536), 0.2)
                if more:
                    self.requests.append(more)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def __aenter__(self) -> Upstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


class Reply:
    """What the proxy answered: status, headers (lower-cased), and the stream for more."""

    def __init__(self, status: int | None, headers: dict[str, str], body: bytes,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:  # fmt: skip
        self.status, self.headers, self.body = status, headers, body
        self.reader, self.writer = reader, writer


class Harness:
    """The real proxy on ``tmp/egress.sock`` with a controlled resolver and its log."""

    def __init__(self, tmp: Path, policy: EgressPolicy, names: dict[str, list[str]]) -> None:
        self.sock = tmp / "egress.sock"
        self.log_path = tmp / "egress.log"
        self.policy = policy
        self.names = names
        self.resolved: list[str] = []
        self._writers: list[asyncio.StreamWriter] = []  # every client stream ask() opened

    async def resolve(self, host: str, port: int) -> list[str]:
        self.resolved.append(host)
        if host not in self.names:
            raise OSError(f"no such name {host}")
        return self.names[host]

    async def __aenter__(self) -> Harness:
        self.record = EgressLog(self.log_path, max_bytes=self.policy.limits.max_log_bytes)
        self.proxy = EgressProxy(self.policy, self.record, resolver=self.resolve)
        self.server = await asyncio.start_unix_server(self.proxy.handle, path=str(self.sock))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self._writers:  # a test may keep a reply's stream open: closed here
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        self.server.close()
        await self.proxy.aclose()
        self.record.close()
        self.sock.unlink(missing_ok=True)

    async def ask(self, request: bytes, *, eof: bool = False, wait: float = 10.0) -> Reply:
        """Send ``request``; read the answer's head (and a refusal's body)."""
        r, w = await asyncio.open_unix_connection(str(self.sock))
        self._writers.append(w)
        w.write(request)
        if eof:
            w.write_eof()
        await w.drain()
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), wait)
        except (asyncio.IncompleteReadError, ConnectionError):
            return Reply(None, {}, b"", r, w)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        body = b""
        if status != 200 and "content-length" in headers:
            body = await asyncio.wait_for(r.readexactly(int(headers["content-length"])), wait)
        return Reply(status, headers, body, r, w)

    def records(self) -> list[dict[str, Any]]:
        """The egress log's records so far."""
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines()]


async def read_all(reply: Reply, wait: float = 10.0) -> bytes:
    """Everything the proxy sends on this connection until it closes."""
    return await asyncio.wait_for(reply.reader.read(), wait)
