"""A qemu fork's session (backends/microvm/_fork.py): the host numbers its streams past
its parent's, so what the parent's commands still send is dropped; the guest agent takes
``rekey`` only once greeted, and then cuts the copied session's streams."""

from __future__ import annotations

import socket
import time
from queue import SimpleQueue
from typing import Any

import pytest

from agentbox.backends.microvm._channel import Channel
from agentbox.guest import agent as agent_mod
from agentbox.guest._agent_sys import _Credit
from agentbox.guest.wire import (
    CTRL,
    STDOUT,
    FrameReader,
    ProtocolError,
    decode_ctrl,
    encode_ctrl,
    encode_frame,
)


def test_a_forks_channel_drops_what_its_parents_streams_still_send() -> None:
    host, guest = socket.socketpair()
    broken: list[str] = []
    chan = Channel(host, name="fork", on_broken=broken.append, first_stream=9, last_gw=5)
    try:
        assert chan.open_stream() == 10  # past every stream the parent opened (even)
        # the parent's commands: their output and exit, on streams this host never opened
        guest.sendall(encode_frame(STDOUT, 4, b"tick\n") + encode_ctrl({"op": "exit"}, 4))
        guest.sendall(encode_ctrl({"op": "check_ok"}, 10))
        assert chan.wait(10, {"check_ok"}, 10)["op"] == "check_ok"
        assert not broken and not chan.broken
        # a gateway stream the parent's guest had opened cannot be opened again
        guest.sendall(encode_ctrl({"op": "gw_open"}, 5))
        end = time.monotonic() + 10
        while not broken and time.monotonic() < end:
            time.sleep(0.01)
        assert broken and "gateway stream 5" in broken[0]
    finally:
        chan.close()
        guest.close()


def _replies(sock: socket.socket) -> list[dict[str, Any]]:
    sock.settimeout(5)
    out = []
    for ftype, _, payload in FrameReader().feed(sock.recv(1 << 16)):
        assert ftype == CTRL
        out.append(decode_ctrl(payload))
    return out


def test_rekey_only_once_greeted_and_it_cuts_the_copied_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeded: list[tuple[bytes, Any]] = []
    monkeypatch.setattr(agent_mod, "_reseed", lambda seed, now: seeded.append((seed, now)))
    host, guest = socket.socketpair()
    try:
        a = agent_mod.Agent(guest.fileno())
        msg = {"op": "rekey", "token": "b" * 64, "seed": "ab" * 64, "time": 1.5}
        with pytest.raises(ProtocolError, match="before hello"):
            a.dispatch(CTRL, 0, encode_ctrl(msg, 0)[9:])
        a.token = "a" * 64  # greeted by the parent's host
        stdin: SimpleQueue[bytes | None] = SimpleQueue()
        gw: SimpleQueue[bytes | None] = SimpleQueue()
        a.stdin_q[2], a.gw[3], a.gw_credit[3] = stdin, gw, _Credit(10)
        with pytest.raises(ProtocolError, match="short token"):
            a.dispatch(CTRL, 0, encode_ctrl({**msg, "token": "x"}, 0)[9:])
        a.dispatch(CTRL, 0, encode_ctrl(msg, 0)[9:])
        assert a.token == "b" * 64
        assert seeded == [(bytes.fromhex("ab" * 64), 1.5)]
        assert stdin.get_nowait() is None and gw.get_nowait() is None  # their ends
        assert a.gw_credit[3].wait() == 0  # the upward copy stops
        assert not a.stdin_q
        [reply] = _replies(host)
        assert reply["op"] == "rekey_ok" and reply["boot_id"]
        with pytest.raises(ProtocolError, match="second hello"):
            a.dispatch(CTRL, 0, encode_ctrl({"op": "hello", "token": "c" * 64}, 0)[9:])
    finally:
        host.close()
        guest.close()
