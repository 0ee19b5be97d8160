"""The host side of Firecracker's hybrid vsock handshake, against a real unix-socket peer.

The peer in each test speaks the handshake the way Firecracker's vsock muxer does
(``CONNECT <port>\\n`` in, ``OK <n>\\n`` out, or a bare close while the guest does
not listen) or breaks it (garbage, oversized, slow, truncated replies).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.microvm._vsock import MAX_REPLY, connect_vsock
from agentbox.errors import GuestError, SandboxError

Reply = Callable[[socket.socket, int], None]
"""Handles one accepted connection; gets the connection and its 0-based index."""


class Peer:
    """A unix-socket server in a thread that records what it was sent."""

    def __init__(self, path: Path, reply: Reply, *, delay_bind: float = 0.0) -> None:
        self.path = path
        self.reply = reply
        self.lines: list[bytes] = []
        self.count = 0
        self._stop = threading.Event()
        self._srv: socket.socket | None = None
        self._delay = delay_bind
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not delay_bind:
            self._wait_bound()

    def _wait_bound(self) -> None:
        end = time.monotonic() + 5
        while not self.path.exists() and time.monotonic() < end:
            time.sleep(0.005)

    def _serve(self) -> None:
        if self._delay:
            time.sleep(self._delay)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(self.path))
        srv.listen(16)
        srv.settimeout(0.05)
        self._srv = srv
        while not self._stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                line = b""
                with contextlib.suppress(OSError):
                    while not line.endswith(b"\n") and len(line) < 100:
                        b = conn.recv(1)
                        if not b:
                            break
                        line += b
                self.lines.append(line)
                i = self.count
                self.count += 1
                with contextlib.suppress(OSError):
                    self.reply(conn, i)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._srv is not None:
            self._srv.close()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(reply: Reply, **kw: float) -> Peer:
        p = Peer(tmp_path / "v.sock", reply, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def ok_then(data: bytes = b"", *, after: int = 0, delay: float = 0.0) -> Reply:
    """Close the first ``after`` connections (no guest listener), then answer OK + ``data``."""

    def reply(conn: socket.socket, i: int) -> None:
        if i < after:
            return
        time.sleep(delay)
        conn.sendall(b"OK 1073741824\n" + data)
        # Hold the stream open until the client is done with it.
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            while conn.recv(4096):
                pass

    return reply


def test_good_handshake_leaves_guest_bytes_in_the_stream(peer: Callable[..., Peer]) -> None:
    p = peer(ok_then(b"\x01guest-bytes"))
    with connect_vsock(p.path, 1024, timeout=5) as s:
        assert s.gettimeout() is None, "Channel needs a blocking socket"
        s.settimeout(5)
        got = b""
        while len(got) < 12:
            got += s.recv(64)
        assert got == b"\x01guest-bytes"
    assert p.lines == [b"CONNECT 1024\n"]


def test_retries_until_the_guest_listens(peer: Callable[..., Peer]) -> None:
    p = peer(ok_then(after=3))
    with connect_vsock(p.path, 52, timeout=10):
        pass
    assert p.count == 4
    assert set(p.lines) == {b"CONNECT 52\n"}


def test_waits_for_the_socket_to_appear(peer: Callable[..., Peer]) -> None:
    p = peer(ok_then(), delay_bind=0.3)
    t0 = time.monotonic()
    with connect_vsock(p.path, 1024, timeout=10):
        pass
    assert time.monotonic() - t0 >= 0.25


def test_slow_reply_within_the_deadline(peer: Callable[..., Peer]) -> None:
    p = peer(ok_then(delay=0.5))
    with connect_vsock(p.path, 1024, timeout=10):
        pass
    assert p.count == 1


def test_gives_up_at_the_deadline_naming_the_port(peer: Callable[..., Peer]) -> None:
    p = peer(lambda conn, i: None)  # guest never listens: every connection closed
    t0 = time.monotonic()
    with pytest.raises(GuestError, match=r"vsock port 1024 within 0\.5s") as ei:
        connect_vsock(p.path, 1024, timeout=0.5)
    assert 0.45 <= time.monotonic() - t0 < 3
    assert "nothing listens" in str(ei.value)
    assert p.count > 1


def test_no_socket_at_all_times_out(tmp_path: Path) -> None:
    with pytest.raises(GuestError, match="No such file"):
        connect_vsock(tmp_path / "absent.sock", 1024, timeout=0.2)


@pytest.mark.parametrize(
    "reply",
    [
        b"HELLO\n",
        b"OK\n",
        b"OK -1\n",
        b"OK 12a\n",
        b"ok 5\n",
        b"OK 5 6\n",
        b"OK 99999999999\n",
        b"OK 5\r\n",
        b"\x00\xff\n",
    ],
)
def test_garbage_fails_at_once(peer: Callable[..., Peer], reply: bytes) -> None:
    p = peer(lambda conn, i: conn.sendall(reply))
    t0 = time.monotonic()
    with pytest.raises(GuestError, match="handshake"):
        connect_vsock(p.path, 1024, timeout=5)
    assert time.monotonic() - t0 < 2, "a bad reply must not be retried until the deadline"
    assert p.count == 1


def test_host_port_beyond_32_bits_is_refused(peer: Callable[..., Peer]) -> None:
    p = peer(lambda conn, i: conn.sendall(b"OK 4294967296\n"))
    with pytest.raises(GuestError, match="out of range"):
        connect_vsock(p.path, 1024, timeout=5)


def test_oversized_reply_is_bounded(peer: Callable[..., Peer]) -> None:
    p = peer(lambda conn, i: conn.sendall(b"O" * 1_000_000))
    with pytest.raises(GuestError, match=f"longer than {MAX_REPLY}"):
        connect_vsock(p.path, 1024, timeout=5)


def test_reply_cut_mid_line_fails(peer: Callable[..., Peer]) -> None:
    p = peer(lambda conn, i: conn.sendall(b"OK 12"))
    with pytest.raises(GuestError, match="mid-reply"):
        connect_vsock(p.path, 1024, timeout=5)


def test_silent_peer_is_retried_then_times_out(
    peer: Callable[..., Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.backends.microvm import _vsock

    monkeypatch.setattr(_vsock, "HANDSHAKE_TIMEOUT", 0.2)
    p = peer(lambda conn, i: time.sleep(0.5))  # accepts, never answers
    with pytest.raises(GuestError, match="no answer"):
        connect_vsock(p.path, 1024, timeout=0.9)
    assert p.count >= 2


def test_dead_vmm_stops_the_wait(peer: Callable[..., Peer]) -> None:
    p = peer(lambda conn, i: None)
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="VMM exited"):
        connect_vsock(p.path, 1024, timeout=30, alive=lambda: False)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("port", [0, -1, 1 << 32])
def test_port_out_of_range(tmp_path: Path, port: int) -> None:
    with pytest.raises(SandboxError, match="out of range"):
        connect_vsock(tmp_path / "v.sock", port, timeout=1)


def test_a_socket_path_longer_than_sun_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.backends.microvm import _vsock

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    alias = tmp_path / "alias"  # the peer binds through a short alias of the same dir
    alias.symlink_to(deep)
    p = Peer(alias / "v.sock", ok_then())
    try:
        long = deep / "v.sock"
        assert len(str(long)) > 108
        with connect_vsock(long, 1024, timeout=5):
            pass
        assert p.lines == [b"CONNECT 1024\n"]
        # Control: without the short alias the kernel refuses the path outright.
        monkeypatch.setattr(_vsock, "_SUN_PATH_MAX", 10**6)
        with pytest.raises(SandboxError, match="too long"):
            connect_vsock(long, 1024, timeout=1)
    finally:
        p.close()
