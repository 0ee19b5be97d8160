"""The guest channel's wire format and the host's defensive reader, over real sockets."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from agentbox.backends.microvm._channel import MAX_QUEUED_BYTES, MSG_OVERHEAD, Channel, GuestTimeout
from agentbox.backends.microvm._guest import GuestSession, KernelFacts
from agentbox.errors import GuestError
from agentbox.guest.agent import (
    CTRL,
    GW,
    MAX_CTRL,
    MAX_PAYLOAD,
    STDOUT,
    FrameReader,
    ProtocolError,
    decode_ctrl,
    encode_ctrl,
    encode_frame,
    proof,
)


def test_frames_roundtrip_in_any_chunking() -> None:
    blob = (
        encode_ctrl({"op": "x", "n": 1}, 4)
        + encode_frame(STDOUT, 4, b"abc")
        + encode_frame(GW, 7, b"")
    )
    for size in (1, 3, 9, len(blob)):
        r = FrameReader()
        got = []
        for i in range(0, len(blob), size):
            got += r.feed(blob[i : i + size])
        assert got == [(CTRL, 4, b'{"op":"x","n":1}'), (STDOUT, 4, b"abc"), (GW, 7, b"")]


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack(">BII", 99, 0, 0),  # unknown type
        struct.pack(">BII", STDOUT, 0, MAX_PAYLOAD + 1),  # oversized data frame
        struct.pack(">BII", CTRL, 0, MAX_CTRL + 1),  # oversized control frame
    ],
)
def test_reader_rejects_bad_headers_before_buffering(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        FrameReader().feed(raw)


@pytest.mark.parametrize("payload", [b"not json", b"[1,2]", b'{"no":"op"}', b'{"op":3}', b"\xff"])
def test_ctrl_must_be_an_object_with_an_op(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_ctrl(payload)


def test_encoder_refuses_what_the_reader_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        encode_frame(STDOUT, 0, b"x" * (MAX_PAYLOAD + 1))
    with pytest.raises(ProtocolError):
        encode_ctrl({"op": "x", "pad": "y" * MAX_CTRL})


def test_proof_depends_on_token_and_nonce() -> None:
    assert proof("t", "n") != proof("t", "m") != proof("u", "n")


class FakeGuest:
    """The guest end of a socketpair, scripted by the test."""

    def __init__(self) -> None:
        self.host_sock, self.sock = socket.socketpair()
        self.broken: list[str] = []
        self.chan = Channel(self.host_sock, name="fake", on_broken=self.broken.append)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.chan.close()
        self.sock.close()


@pytest.fixture
def guest() -> FakeGuest:
    g = FakeGuest()
    yield g  # type: ignore[misc]
    g.close()


def _wait_broken(g: FakeGuest, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not g.broken and time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.parametrize(
    "bad",
    [
        struct.pack(">BII", 42, 0, 0),
        struct.pack(">BII", STDOUT, 2, 1 << 30),
        encode_frame(CTRL, 0, b"{broken"),
    ],
)
def test_malformed_frame_breaks_the_channel_and_wakes_waiters(guest: FakeGuest, bad: bytes) -> None:
    done: list[BaseException] = []

    def waiter() -> None:
        try:
            guest.chan.wait(0, {"ready"}, 30)
        except GuestError as exc:
            done.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    guest.send(bad)
    t.join(10)
    assert done and not isinstance(done[0], GuestTimeout)
    _wait_broken(guest)
    assert guest.broken and "protocol violation" in guest.broken[0]
    with pytest.raises(GuestError):
        guest.chan.send_ctrl({"op": "check", "nonce": "x"})


def test_control_flood_breaks_the_channel(guest: FakeGuest) -> None:
    msg = encode_ctrl({"op": "noise"})
    guest.send(msg * (MAX_QUEUED_BYTES // (len(msg) + MSG_OVERHEAD - 9) + 10))
    _wait_broken(guest)
    assert guest.broken and "flood" in guest.broken[0]


def test_data_flood_to_unknown_streams_is_dropped_and_host_stays_responsive(
    guest: FakeGuest,
) -> None:
    chunk = encode_frame(STDOUT, 12345, b"x" * MAX_PAYLOAD)

    def flood() -> None:
        for _ in range(200):  # 50 MiB
            guest.send(chunk)
        guest.send(encode_ctrl({"op": "ready", "release": "r", "boot_id": "b"}))

    t = threading.Thread(target=flood)
    t.start()
    assert guest.chan.wait(0, {"ready"}, 60)["op"] == "ready"
    t.join(30)
    assert not guest.broken


def test_silent_guest_times_out(guest: FakeGuest) -> None:
    t0 = time.monotonic()
    with pytest.raises(GuestTimeout):
        guest.chan.wait(0, {"ready"}, 0.3)
    assert time.monotonic() - t0 < 5


def _answer_checks(g: FakeGuest, facts: dict[str, str], token_box: list[str], wrong: bool) -> None:
    r = FrameReader()
    while True:
        try:
            data = g.sock.recv(65536)
        except OSError:
            return
        if not data:
            return
        for _, stream, payload in r.feed(data):
            msg = json.loads(payload)
            if msg["op"] == "hello":
                token_box.append(msg["token"])
                g.send(encode_ctrl({"op": "hello_ok", **facts}))
            elif msg["op"] == "check":
                nonce = msg["nonce"]
                p = proof("not-the-token" if wrong else token_box[0], nonce)
                g.send(encode_ctrl({"op": "check_ok", "nonce": nonce, "proof": p, **facts}, stream))


@pytest.mark.parametrize(
    ("facts", "wrong_token", "ok"),
    [
        ({"release": "6.1.0-guest", "boot_id": "guest-boot"}, False, True),
        ({"release": "HOST", "boot_id": "guest-boot"}, False, False),
        ({"release": "6.1.0-guest", "boot_id": "HOST-BOOT"}, False, False),
        ({"release": "6.1.0-guest", "boot_id": "guest-boot"}, True, False),
    ],
)
def test_kernel_and_nonce_check(
    guest: FakeGuest, facts: dict[str, str], wrong_token: bool, ok: bool
) -> None:
    tokens: list[str] = []
    t = threading.Thread(
        target=_answer_checks, args=(guest, facts, tokens, wrong_token), daemon=True
    )
    t.start()
    s = GuestSession(guest.chan, name="fake", host=KernelFacts("HOST", "HOST-BOOT"))
    if facts["release"] == "HOST" or facts["boot_id"] == "HOST-BOOT":
        with pytest.raises(GuestError, match="host's kernel"):
            s.hello(uid=1, mount_data=False, gateway=None, timeout=5)
        return
    s.hello(uid=1, mount_data=False, gateway=None, timeout=5)
    if ok:
        assert s.check(timeout=5)["release"] == "6.1.0-guest"
    else:
        with pytest.raises(GuestError, match="nonce"):
            s.check(timeout=5)


def test_a_guest_that_stops_reading_cannot_wedge_a_send(
    guest: FakeGuest, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentbox.backends.microvm._channel as ch

    monkeypatch.setattr(ch, "SEND_TIMEOUT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(GuestError, match="send failed"):
        for _ in range(10_000):  # the fake guest never reads
            guest.chan.send(STDOUT, 2, b"x" * MAX_PAYLOAD)
    assert time.monotonic() - t0 < 10
    assert guest.broken


def test_gateway_streams_are_capped(guest: FakeGuest, tmp_path: Path) -> None:
    import agentbox.backends.microvm._gwstreams as g

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "gw.sock"))
    srv.listen(200)
    s = GuestSession(guest.chan, name="fake", host=KernelFacts("H", "B"))
    s.gateway_socket = tmp_path / "gw.sock"
    for i in range(g.MAX_GATEWAY_STREAMS + 5):
        s.on_gateway_open(2 * i + 1)
    assert s._gw_open == g.MAX_GATEWAY_STREAMS
    # the refused ones got an immediate EOF frame
    r = FrameReader()
    guest.sock.settimeout(5)
    eofs: set[int] = set()
    while len(eofs) < 5:
        for ftype, stream, payload in r.feed(guest.sock.recv(65536)):
            if ftype == GW and payload == b"":
                eofs.add(stream)
    assert eofs == {2 * i + 1 for i in range(g.MAX_GATEWAY_STREAMS, g.MAX_GATEWAY_STREAMS + 5)}
    srv.close()


def test_gateway_connect_waits_out_a_full_accept_backlog(guest: FakeGuest, tmp_path: Path) -> None:
    # A unix listener whose backlog is full refuses a non-blocking connect at once
    # (EAGAIN): a burst of guest connections must wait for the gateway, not fail.
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "gw.sock"))
    srv.listen(1)
    accepted: list[socket.socket] = []

    def accept_late() -> None:
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            while True:
                accepted.append(srv.accept()[0])

    threading.Thread(target=accept_late, daemon=True).start()
    s = GuestSession(guest.chan, name="fake", host=KernelFacts("H", "B"))
    s.gateway_socket = tmp_path / "gw.sock"
    for i in range(6):
        s.on_gateway_open(2 * i + 1)
    assert s._gw_open == 6
    srv.close()
    for c in accepted:
        c.close()
