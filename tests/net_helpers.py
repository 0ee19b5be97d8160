"""Loopback helpers shared by tests that start servers as child processes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], *, timeout: float = 30.0) -> None:
    """Until something accepts on 127.0.0.1:``port``; fail early if ``proc`` exits."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode() if proc.stderr else "exited early")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def mcp_http_transport(url: str, token: str) -> AsyncIterator[Any]:
    """The MCP SDK's streamable-HTTP transport with a bearer token, owning its httpx client
    (the SDK leaves a client it was given open: its connections were left to the GC)."""
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams
