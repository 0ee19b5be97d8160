"""A hostile guest agent against the host's channel and session, over a real socketpair.

The fake guest speaks the wire protocol byte for byte (the host's real
:class:`Channel` and :class:`GuestSession` on the other end) and does what a
compromised guest agent could: flood control messages that parse into much more
than they weigh, talk on streams nobody reads, send gateway data past its credit,
report exit codes that are not exit codes. Each must end with the channel broken
(the VM killed) and the host's memory where it was: "it only gets to be slow,
and then it is killed".
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends.microvm._channel import MAX_QUEUED_BYTES, Channel
from agentbox.backends.microvm._guest import GuestSession, KernelFacts
from agentbox.backends.microvm._gwstreams import MAX_GATEWAY_HELD
from agentbox.errors import GuestError
from agentbox.guest.agent import (
    CTRL,
    GW,
    GW_WINDOW,
    MAX_CTRL,
    MAX_PAYLOAD,
    FrameReader,
    encode_ctrl,
    encode_frame,
    proof,
)

FACTS = {"release": "6.1.0-guest", "boot_id": "guest-boot"}
HOST = KernelFacts("HOST", "HOST-BOOT")
MIB = 1024 * 1024


class Hostile:
    """The guest end of a socketpair; the host end is a real Channel + GuestSession."""

    def __init__(self) -> None:
        self.host_sock, self.sock = socket.socketpair()
        self.broken: list[str] = []
        self.chan = Channel(self.host_sock, name="hostile", on_broken=self.broken.append)
        self.session = GuestSession(self.chan, name="hostile", host=HOST)
        self.chan._on_gateway_open = self.session.on_gateway_open
        self.token: list[str] = []
        self.frames: list[tuple[int, int, bytes]] = []  # what the host sent, beyond the session
        self.on_ctrl: Callable[[int, dict[str, object]], None] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._answer, daemon=True).start()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def ctrl(self, msg: dict[str, object], stream: int = 0) -> None:
        self.send(encode_ctrl(msg, stream))

    def _answer(self) -> None:
        r = FrameReader()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            for ftype, stream, payload in r.feed(data):
                if ftype != CTRL:
                    with self._lock:
                        self.frames.append((ftype, stream, payload))
                    continue
                msg = json.loads(payload)
                if msg["op"] == "hello":
                    self.token.append(msg["token"])
                    self.ctrl({"op": "hello_ok", **FACTS})
                elif msg["op"] == "check":
                    p = proof(self.token[0], msg["nonce"])
                    self.ctrl(
                        {"op": "check_ok", "nonce": msg["nonce"], "proof": p, **FACTS}, stream
                    )
                else:
                    with self._lock:
                        self.frames.append((ftype, stream, payload))
                    if self.on_ctrl is not None:
                        self.on_ctrl(stream, msg)

    def greet(self) -> None:
        self.session.hello(uid=1, mount_data=False, gateway=None, timeout=10)

    def sent(self, ftype: int, stream: int | None = None) -> list[bytes]:
        with self._lock:
            return [p for t, s, p in self.frames if t == ftype and stream in (None, s)]

    def wait_broken(self, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while not self.broken and time.monotonic() < end:
            time.sleep(0.01)
        return self.broken[0] if self.broken else ""

    def close(self) -> None:
        self.chan.close()
        self.sock.close()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    h = Hostile()
    yield h
    h.close()


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _fat_ctrl(stream: int) -> bytes:
    """A control frame of almost MAX_CTRL bytes that parses into ~25 times that."""
    body = '{"op":"noise","p":[' + ",".join(["[]"] * ((MAX_CTRL - 40) // 3)) + "]}"
    return encode_frame(CTRL, stream, body.encode())


def _flood(h: Hostile, frames: Iterator[bytes]) -> None:
    for frame in frames:
        try:
            h.send(frame)
        except OSError:  # the host hung up on us
            return


# ------------------------------------------------------------------ control data


def test_control_messages_nobody_reads_are_bounded_by_bytes(hostile: Hostile) -> None:
    # Before the session is greeted stream 0 is read, and host streams are open:
    # the guest piles fat messages on all of them (the review's 500 frames of 64 KiB).
    streams = [0] + [hostile.chan.open_stream() for _ in range(4)]
    before = _rss()
    _flood(hostile, (_fat_ctrl(streams[i % len(streams)]) for i in range(500)))
    why = hostile.wait_broken()
    assert "floods control messages" in why
    assert hostile.chan.queued_bytes <= MAX_QUEUED_BYTES
    assert _rss() - before < 64 * MIB


@pytest.mark.parametrize(
    "where",
    ["stream 0 after hello", "a host stream never opened", "a gateway stream", "a reused gw id"],
)
def test_a_control_message_on_a_stream_nobody_reads_breaks_the_channel(
    hostile: Hostile, tmp_path: Path, where: str
) -> None:
    hostile.greet()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        if where == "stream 0 after hello":
            hostile.ctrl({"op": "noise"}, 0)
        elif where == "a host stream never opened":
            hostile.ctrl({"op": "noise"}, 1000)
        else:
            srv.bind(str(tmp_path / "gw.sock"))
            srv.listen(8)
            hostile.session.gateway_socket = tmp_path / "gw.sock"
            hostile.ctrl({"op": "gw_open"}, 7)
            hostile.ctrl({"op": "noise" if where == "a gateway stream" else "gw_open"}, 7)
        assert "protocol violation" in hostile.wait_broken()


def test_a_late_answer_on_a_closed_stream_is_dropped(hostile: Hostile) -> None:
    hostile.greet()
    sid = hostile.chan.open_stream()
    hostile.chan.close_stream(sid)  # the host timed out waiting
    hostile.ctrl({"op": "check_ok", "late": True}, sid)
    assert hostile.session.check(timeout=10)["release"] == FACTS["release"]
    assert not hostile.broken
    assert hostile.chan.queued_bytes == 0


def test_nesting_deeper_than_the_parser_breaks_the_channel(hostile: Hostile) -> None:
    hostile.send(encode_frame(CTRL, 0, b"[" * (MAX_CTRL - 1)))
    assert "protocol violation" in hostile.wait_broken()


# ------------------------------------------------------------------ exit codes


@pytest.mark.parametrize(
    "code", ["abc", [1], "1" * 5000, 10**30, 256, -256, 1.5, True, None, {"a": 1}]
)
def test_an_exit_code_that_is_not_one_is_a_protocol_violation(
    hostile: Hostile, code: object
) -> None:
    hostile.greet()
    hostile.on_ctrl = lambda stream, msg: (
        hostile.ctrl({"op": "exit", "code": code}, stream) if msg["op"] == "exec" else None
    )
    with pytest.raises(GuestError, match="protocol violation"):
        hostile.session.exec(["true"], env={}, cwd="/", uid=1, timeout=10)
    assert "exit code" in hostile.wait_broken()


@pytest.mark.parametrize(("code", "want"), [(0, 0), (3, 3), (255, 255), (-9, 137), (-255, 383)])
def test_an_exit_code_in_range_is_reported(hostile: Hostile, code: int, want: int) -> None:
    hostile.greet()
    hostile.on_ctrl = lambda stream, msg: (
        hostile.ctrl({"op": "exit", "code": code}, stream) if msg["op"] == "exec" else None
    )
    res = hostile.session.exec(["true"], env={}, cwd="/", uid=1, timeout=10)
    assert res.exit_code == want
    assert not hostile.broken


# ------------------------------------------------------------------ gateway streams


class StalledGateway:
    """A gateway socket that accepts and reads nothing (uvicorn behind a pipelined request)."""

    def __init__(self, path: Path) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(128)
        self.conns: list[socket.socket] = []
        self.read = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.conns.append(conn)

    def drain(self, conn: socket.socket) -> int:
        conn.settimeout(0.5)
        n = 0
        try:
            while chunk := conn.recv(1 << 20):
                n += len(chunk)
        except TimeoutError:
            pass
        return n

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def test_gateway_credit_follows_what_the_gateway_drains(hostile: Hostile, tmp_path: Path) -> None:
    gw = StalledGateway(tmp_path / "gw.sock")
    try:
        hostile.greet()
        hostile.session.gateway_socket = tmp_path / "gw.sock"
        hostile.ctrl({"op": "gw_open"}, 1)
        chunk = b"x" * (64 * 1024)
        for _ in range(GW_WINDOW // len(chunk)):  # exactly the window: allowed
            hostile.send(encode_frame(GW, 1, chunk))
        end = time.monotonic() + 10
        while not gw.conns and time.monotonic() < end:
            time.sleep(0.01)
        # The gateway reads: the host grants what it passed on, never more than it took.
        got = gw.drain(gw.conns[0])
        end = time.monotonic() + 10
        granted = 0
        while granted < got and time.monotonic() < end:
            granted = sum(json.loads(p)["n"] for p in hostile.sent(CTRL, 1))
            time.sleep(0.01)
        assert 0 < granted <= got
        assert all(json.loads(p)["op"] == "gw_credit" for p in hostile.sent(CTRL, 1))
        assert not hostile.broken
    finally:
        gw.close()


def test_gateway_data_past_the_credit_breaks_the_channel_not_the_host(
    hostile: Hostile, tmp_path: Path
) -> None:
    gw = StalledGateway(tmp_path / "gw.sock")
    try:
        hostile.greet()
        hostile.session.gateway_socket = tmp_path / "gw.sock"
        before = _rss()
        # The review's attack with a guest agent that ignores credit: 60 streams,
        # 1 GiB pushed into a gateway that reads nothing.
        for i in range(60):
            hostile.ctrl({"op": "gw_open"}, 2 * i + 1)
        frame = b"y" * MAX_PAYLOAD
        _flood(hostile, (encode_frame(GW, 2 * (i % 60) + 1, frame) for i in range(4096)))
        why = hostile.wait_broken()
        assert "past its gateway stream's credit" in why
        assert hostile.session.gateway_held <= MAX_GATEWAY_HELD
        assert _rss() - before < MAX_GATEWAY_HELD + 48 * MIB
    finally:
        gw.close()


def test_a_broken_channel_ends_its_gateway_connections(hostile: Hostile, tmp_path: Path) -> None:
    gw = StalledGateway(tmp_path / "gw.sock")
    try:
        hostile.greet()
        hostile.session.gateway_socket = tmp_path / "gw.sock"
        for sid in (1, 3, 5):
            hostile.ctrl({"op": "gw_open"}, sid)
            for _ in range(4):  # the window, stuck: nothing reads
                hostile.send(encode_frame(GW, sid, b"q" * (GW_WINDOW // 4)))
        end = time.monotonic() + 10
        while (len(gw.conns) < 3 or hostile.session._gw_open < 3) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(gw.conns) == 3 and hostile.session._gw_open == 3
        hostile.send(encode_frame(CTRL, 0, b"{broken"))  # the VM gets killed for this
        assert "protocol violation" in hostile.wait_broken()
        # the gateway sees every connection end, and the host lets go of what it held
        for conn in gw.conns:
            conn.settimeout(10)
            while conn.recv(1 << 20):
                pass
        end = time.monotonic() + 10
        while hostile.session._gw_open and time.monotonic() < end:
            time.sleep(0.01)
        assert hostile.session._gw_open == 0
        assert hostile.session.gateway_held == 0
    finally:
        gw.close()
