"""The gateway's HTTP framing (llhttp, both sides) and its streaming path: each event of a
stream reaches the client as it comes (nothing waits for more), usage is metered exactly,
a client that hangs up drops the upstream's connection at once, a request head has a
bound, and an upgrade request gets one plain answer and its connection closes."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from gateway_helpers import CHAT_SCRIPT, running_gateway

MSG = {"model": "x", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
WAIT = 30.0  # a bounded wait for a loaded host, never a timing assertion


def _ev(kind: str, doc: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(doc)}\n\n".encode()


START = _ev("message_start", {"type": "message_start", "message": {
    "id": "msg_p", "model": "m", "usage": {"input_tokens": 17, "output_tokens": 1}}})  # fmt: skip
DELTA = _ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": "hello"}})  # fmt: skip
END = _ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                            "usage": {"output_tokens": 29}})  # fmt: skip
END += _ev("message_stop", {"type": "message_stop"})


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StepUpstream:
    """A raw upstream that sends a stream's events only when the test says so: the first
    event, then (after ``go``) a delta and a usage event cut in two writes. ``closed`` is
    set when the gateway closes the connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.go = threading.Event()
        self.closed = threading.Event()
        """The gateway closed the upstream connection."""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(WAIT)
        try:
            conn, _ = self.sock.accept()
        except OSError:  # never asked (the test failed before), or stopped
            return
        with conn:
            conn.settimeout(WAIT)
            data = b""
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" + _chunk(START))  # fmt: skip
            # Until the test says go, or the gateway closes the connection (its client hung
            # up): a closed connection reads as EOF.
            deadline = time.monotonic() + WAIT
            while not self.go.is_set():
                if time.monotonic() > deadline:
                    return
                if select.select([conn], [], [], 0.05)[0]:
                    try:
                        if conn.recv(1) == b"":
                            self.closed.set()
                            return
                    except OSError:
                        self.closed.set()
                        return
            try:
                half = len(END) // 3  # inside message_delta's JSON
                conn.sendall(_chunk(DELTA + END[:half]))
                # Whatever the gateway did with the split event, the rest comes now.
                conn.sendall(_chunk(END[half:]) + b"0\r\n\r\n")
                # Kept for another request until the gateway closes it (at its stop, or
                # at once when its client hung up mid-stream).
                conn.recv(1)
            except OSError:
                pass
            self.closed.set()

    def stop(self) -> None:
        self.go.set()
        self.sock.close()
        self.thread.join(WAIT)


@contextmanager
def step_upstream() -> Iterator[StepUpstream]:
    up = StepUpstream()
    try:
        yield up
    finally:
        up.stop()


def test_each_event_reaches_the_client_as_it_comes_and_usage_is_exact(tmp_path: Path) -> None:
    with step_upstream() as up, running_gateway(tmp_path, upstream=up.url) as gw:
        body = {**MSG, "stream": True}
        with (
            httpx.Client(timeout=WAIT) as c,
            c.stream("POST", gw.url + "/v1/messages", json=body, headers=gw.auth()) as r,
        ):
            assert r.status_code == 200
            it = r.iter_raw()
            got = b""
            # The upstream sends nothing more until the client has the first event: a
            # gateway that held the stream's first bytes (or its head) would wait forever.
            while b"message_start" not in got:
                got += next(it)
            up.go.set()
            for piece in it:
                got += piece
        assert got == START + DELTA + END
        u = gw.usage()
        assert (u.input, u.output, u.requests, u.dropped_streams) == (17, 29, 1, 0)
        assert u.reserved == 0


def test_a_client_that_hangs_up_drops_the_upstream_connection(tmp_path: Path) -> None:
    with step_upstream() as up, running_gateway(tmp_path, upstream=up.url) as gw:
        body = {**MSG, "stream": True}
        with (
            httpx.Client(timeout=WAIT) as c,
            c.stream("POST", gw.url + "/v1/messages", json=body, headers=gw.auth()) as r,
        ):
            got = b""
            it = r.iter_raw()
            while b"message_start" not in got:
                got += next(it)
        # Hung up mid-stream: the gateway closes its upstream connection while the stream
        # is still waiting for its next event, and bills the worst case for output.
        assert up.closed.wait(WAIT)  # while the gateway still runs
        u = gw.usage()
        assert u.dropped_streams == 1 and u.reserved == 0
        assert (u.input, u.output) == (17, MSG["max_tokens"])


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _head(token: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {token}\r\n{extra}"
    return (
        head + f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()


def test_a_request_head_has_a_bound(tmp_path: Path) -> None:
    body = json.dumps(MSG).encode()
    with running_gateway(tmp_path, script=CHAT_SCRIPT) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        big = _raw(port, _head(gw.token, body, f"x-pad: {'a' * (70 << 10)}\r\n") + body)
        assert big.startswith(b"HTTP/1.1 400 ")  # and the connection closed (EOF above)
        ok = _raw(port, _head(gw.token, body, f"x-pad: {'a' * (30 << 10)}\r\n"
                              "connection: close\r\n") + body)  # fmt: skip
        assert ok.startswith(b"HTTP/1.1 200 ")
        assert gw.usage().requests == 1  # the refused head never reached the app


def test_an_upgrade_request_is_answered_plainly_then_closed(tmp_path: Path) -> None:
    body = json.dumps(MSG).encode()
    hidden = b"POST /v1/messages/count_tokens HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
    with running_gateway(tmp_path, script=CHAT_SCRIPT) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        extra = "connection: upgrade\r\nupgrade: websocket\r\n"
        out = _raw(port, _head(gw.token, body, extra) + body + hidden)
        statuses = [line[9:12] for line in out.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
        # One answer (llhttp stops at an upgrade request's head, so its body is not read
        # either: a 400 for the empty body), then EOF: nothing after it is read as HTTP.
        assert statuses == [b"400"], out[:300]
        assert gw.usage().requests == 1
