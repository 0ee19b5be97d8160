"""Header and body read timeouts and the per-gateway connection cap (issue 18 item 4).

Before: 3,000 connections holding unfinished headers all stayed open (uvicorn
starts no timer on a new connection), and a sandbox could open as many as its
nofile limit allowed on the gateway's socket, around the relay's cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.core import proc as _proc
from gateway_helpers import CHAT_SCRIPT, running_gateway, wait_usage, write_script

SLOW_HEAD = b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nX-Pad: " + b"a" * 1000


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF or reset); False while it is still open."""
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_all_closed(socks: list[socket.socket], timeout: float = 60.0) -> None:
    open_ = list(socks)
    deadline = time.monotonic() + timeout
    while open_:
        open_ = [s for s in open_ if not _closed_by_peer(s)]
        if not open_:
            return
        assert time.monotonic() < deadline, f"{len(open_)} of {len(socks)} connections still open"
        time.sleep(0.2)


def _slow_clients(path: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        with contextlib.suppress(OSError):  # already closed by the cap: fine
            s.sendall(SLOW_HEAD)
        s.setblocking(False)
        socks.append(s)
    return socks


def _request(gw: Any, transport: httpx.HTTPTransport) -> httpx.Response:
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(transport=transport, timeout=30) as c:
        return c.post(gw.url + "/v1/messages", json=body, headers=gw.auth())


def test_slow_headers_closed_and_connections_capped(tmp_path: Path) -> None:
    with running_gateway(
        tmp_path, script=CHAT_SCRIPT, unix=True, header_timeout=1.0, max_connections=40
    ) as gw:
        assert gw.uds is not None
        socks = _slow_clients(gw.uds, 300)
        try:
            _wait_all_closed(socks)
        finally:
            for s in socks:
                s.close()
        # The gateway still serves, and counted what it closed.
        r = _request(gw, httpx.HTTPTransport(uds=gw.uds))
        assert r.status_code == 200, r.text
        refusals = gw.usage().refusals
        assert refusals.get("connections", 0) >= 300 - 40
        assert refusals.get("header_timeout", 0) >= 1
        assert sum(refusals.values()) >= 300


def test_trickled_body_times_out_and_frees_its_slot(tmp_path: Path) -> None:
    with running_gateway(
        tmp_path, script=CHAT_SCRIPT, unix=True, body_timeout=1.0, max_concurrency=1
    ) as gw:
        assert gw.uds is not None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(gw.uds)
        head = (
            f"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: {gw.token}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"max_tokens": 5,')
        s.setblocking(False)
        try:
            _wait_all_closed([s])
        finally:
            s.close()
        # Its concurrency slot is free again: a normal request gets through.
        r = _request(gw, httpx.HTTPTransport(uds=gw.uds))
        assert r.status_code == 200, r.text
        assert gw.usage().refusals.get("body_timeout") == 1


def test_idle_keep_alive_is_not_a_slow_header(tmp_path: Path) -> None:
    """A kept-alive connection idle past the header timeout is still usable."""
    with running_gateway(tmp_path, script=CHAT_SCRIPT, unix=True, header_timeout=0.5) as gw:
        assert gw.uds is not None
        body = json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        with httpx.Client(transport=httpx.HTTPTransport(uds=gw.uds), timeout=30) as c:
            for _ in range(2):
                r = c.post(gw.url + "/v1/messages", content=body, headers=gw.auth())
                assert r.status_code == 200
                assert r.headers.get("connection") != "close"
                time.sleep(1.5)
        assert "header_timeout" not in gw.usage().refusals


@pytest.mark.slow
def test_3000_slow_header_connections_on_a_gateway_process(tmp_path: Path) -> None:
    """The review's flood, on a gateway started like the launcher starts it."""
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(24))
    sock = tmp_path / "gw.sock"
    usage = tmp_path / "usage.json"
    script = write_script(tmp_path, CHAT_SCRIPT)
    argv = [sys.executable, "-m", "agentbox.gateway", "--listen", f"unix:{sock}"]
    argv += ["--token-file", str(token_file), "--model", "replay-demo", "--budget", "1000"]
    argv += ["--usage-file", str(usage), "--upstream", f"replay:{script}"]
    argv += ["--header-timeout", "3"]
    with (tmp_path / "gateway.log").open("wb") as log:
        gw = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert gw.poll() is None and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.05)
        socks = _slow_clients(str(sock), 3000)
        try:
            _wait_all_closed(socks, timeout=120)
        finally:
            for s in socks:
                s.close()
        u = wait_usage(usage, lambda u: sum(u.refusals.values()) >= 3000)
        assert u.refusals.get("connections", 0) >= 3000 - 128, u.refusals
        assert gw.poll() is None  # it is still serving
        assert (tmp_path / "gateway.log").stat().st_size < 64_000  # no line per connection
    finally:
        _proc.kill_group(gw)  # type: ignore[arg-type]


def test_bytes_in_flight_capped_with_429(tmp_path: Path) -> None:
    """--max-held: a request whose body would pass the bytes held by requests in flight
    gets 429 with retry-after (memory, issue 11.4); once the first is answered it passes."""
    script = {"main": "all", "turns": [{"text": "ok", "delay": 1.5}]}
    body = json.dumps(
        {"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 5000}]}
    ).encode()
    with running_gateway(tmp_path, script=script, max_body=8000, max_held=8000) as gw:

        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                first = asyncio.ensure_future(
                    c.post(gw.url + "/v1/messages", content=body, headers=gw.auth())
                )
                while gw.gateway.held == 0:  # noqa: ASYNC110  (another thread sets it)
                    await asyncio.sleep(0.01)
                second = await c.post(gw.url + "/v1/messages", content=body, headers=gw.auth())
                return [await first, second]

        first, second = asyncio.run(two())
        assert first.status_code == 200, first.text
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert "in flight" in second.json()["error"]["message"]
        again = httpx.post(gw.url + "/v1/messages", content=body, headers=gw.auth(), timeout=30)
        assert again.status_code == 200
        assert gw.usage().refusals == {"busy": 1} and gw.gateway.held == 0
