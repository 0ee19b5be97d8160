"""The in-sandbox relay (``guest/relay.py``), run as the image runs it, on real sockets.

A real ``python3 -I -S relay.py`` process listens on 127.0.0.1 and relays to a
real unix-socket server in the test: alone (an image built before the C relay),
and with the C relay built next to it as the image build does (``relay.py``'s
server then ``exec``s it: no Python stays resident). These pin the relay's semantics (byte for
byte in both directions at once, across many buffer fills; half-close; an
upstream reset or absence closes the client) so its copy loop can be tuned; how
fast it is goes in ``bench/egress.py``, not here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.image._relay import RELAY_BINARY, RELAY_SOURCE, compile_relay

RELAY = Path(__file__).resolve().parents[2] / "src/agentbox/guest/relay.py"
KINDS = ["python", "native"]
BULK = 6 * 1024 * 1024 + 12345  # many buffer fills, not a multiple of any buffer size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    """Whether 127.0.0.1:``port`` is in LISTEN state (from /proc/net/tcp)."""
    want = f"0100007F:{port:04X}"
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(f[1] == want and f[3] == "0A" for f in (line.split() for line in lines))


def _recv_all(s: socket.socket) -> bytes:
    parts = []
    while chunk := s.recv(1 << 16):
        parts.append(chunk)
    return b"".join(parts)


class _Upstream:
    """A unix-socket server running ``handler`` on each connection in a thread."""

    def __init__(self, path: Path, handler: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.handler = handler
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                self.handler(conn)
            except BaseException as exc:  # reported by the test, not lost in a thread
                self.errors.append(exc)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.fixture(scope="module")
def guest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """relay.py with the C relay built next to it, as ``/opt/agentbox`` in the image."""
    d = tmp_path_factory.mktemp("guest")
    shutil.copyfile(RELAY, d / "relay.py")
    compile_relay(RELAY.with_name(RELAY_SOURCE), d / RELAY_BINARY)
    return d


def _script(kind: str, guest_dir: Path) -> Path:
    return RELAY if kind == "python" else guest_dir / "relay.py"


def _start(script: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(script), "--port", str(port), *args]
    )  # fmt: skip
    # Wait for LISTEN without connecting: a probe connection would be relayed
    # to the test's upstream and taken for the test's own.
    deadline = time.monotonic() + 20
    while not _listening(port):
        assert proc.poll() is None, f"relay exited with {proc.returncode}"
        assert time.monotonic() < deadline, "relay never listened"
        time.sleep(0.05)
    return proc


@pytest.fixture(params=KINDS)
def relay(
    request: pytest.FixtureRequest, tmp_path: Path, guest_dir: Path
) -> Iterator[tuple[int, Path]]:
    """A running relay: (its port, the unix socket path it relays to)."""
    sock = tmp_path / "gw.sock"
    port = _free_port()
    proc = _start(_script(request.param, guest_dir), port, "--socket", str(sock))
    try:
        # The Python relay became the C one (same pid), or stayed Python without it.
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        assert exe == (str(guest_dir / RELAY_BINARY) if request.param == "native" else exe)
        assert (request.param == "native") != ("python" in Path(exe).name)
        yield port, sock
    finally:
        proc.terminate()
        proc.wait(10)


def test_bulk_both_ways_at_once_byte_for_byte_then_half_close(
    relay: tuple[int, Path],
) -> None:
    port, path = relay
    up_data, down_data = os.urandom(BULK), os.urandom(BULK + 777)
    got_up: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        # Send while receiving: both pumps carry bulk data at the same time.
        sender = threading.Thread(target=conn.sendall, args=(down_data,))
        sender.start()
        got_up.append(_recv_all(conn))  # ends at the client's half-close
        sender.join()
        conn.sendall(b"after-eof")  # an answer sent after the request ended still arrives
        conn.shutdown(socket.SHUT_WR)

    upstream = _Upstream(path, handler)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            received: list[bytes] = []
            reader = threading.Thread(target=lambda: received.append(_recv_all(c)))
            reader.start()
            c.sendall(up_data)
            c.shutdown(socket.SHUT_WR)
            reader.join(60)
            assert not reader.is_alive()
    finally:
        upstream.close()
    assert not upstream.errors, upstream.errors
    assert hashlib.sha256(got_up[0]).digest() == hashlib.sha256(up_data).digest()
    assert len(got_up[0]) == len(up_data)
    assert received[0] == down_data + b"after-eof"


def test_many_small_writes_keep_their_order(relay: tuple[int, Path]) -> None:
    port, path = relay
    messages = [f"{i:05d};".encode() for i in range(3000)]

    def handler(conn: socket.socket) -> None:
        data = _recv_all(conn)
        conn.sendall(data[::-1])

    upstream = _Upstream(path, handler)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            for m in messages:
                c.send(m)
            c.shutdown(socket.SHUT_WR)
            back = _recv_all(c)
    finally:
        upstream.close()
    assert not upstream.errors, upstream.errors
    assert back == b"".join(messages)[::-1]


def test_an_upstream_that_closes_mid_stream_ends_the_client(relay: tuple[int, Path]) -> None:
    port, path = relay

    def handler(conn: socket.socket) -> None:
        conn.recv(10)
        conn.sendall(b"partial")
        # Close without reading the rest: the client must see the end, not hang.

    upstream = _Upstream(path, handler)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(b"x" * 10)
            data = _recv_until_end(c)
    finally:
        upstream.close()
    assert data == b"partial"


def test_no_upstream_closes_the_client(relay: tuple[int, Path]) -> None:
    port, _ = relay  # nothing listens on the socket path
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        assert _recv_until_end(c) == b""


def _recv_until_end(c: socket.socket) -> bytes:
    """What arrives before EOF or a reset (either ends the stream for the client)."""
    parts = []
    try:
        while chunk := c.recv(1 << 16):
            parts.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(parts)


@pytest.mark.parametrize("kind", KINDS)
def test_at_most_max_conns_are_relayed_at_once(tmp_path: Path, guest_dir: Path, kind: str) -> None:
    """A connection over ``--max-conns`` waits in the backlog until one ends."""
    path = tmp_path / "gw.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    server.settimeout(30)
    port = _free_port()
    proc = _start(_script(kind, guest_dir), port, "--socket", str(path), "--max-conns", "1")
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=30) as first,
            socket.create_connection(("127.0.0.1", port), timeout=30) as second,
        ):
            up1, _ = server.accept()
            first.sendall(b"one")
            assert up1.recv(3) == b"one"
            second.sendall(b"two")
            server.settimeout(1.0)  # the second is not relayed while the first lives
            with pytest.raises(TimeoutError):
                server.accept()
            server.settimeout(30)
            first.close()
            up1.close()
            up2, _ = server.accept()  # its turn once the first ended
            assert up2.recv(3) == b"two"
            up2.close()
    finally:
        server.close()
        proc.terminate()
        proc.wait(10)


def test_the_command_runs_as_the_relay_s_pid_and_the_server_is_native(
    tmp_path: Path, guest_dir: Path
) -> None:
    """``relay.py -- CMD``: CMD keeps the pid; the detached server is the C relay."""
    port = _free_port()
    marker = tmp_path / "ran"
    proc = _start(guest_dir / "relay.py", port, "--socket", str(tmp_path / "gw.sock"), "--",
                  sys.executable, "-c", f"import pathlib,time; pathlib.Path({str(marker)!r})"
                  ".write_text('x'); time.sleep(60)")  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert "python" in Path(os.readlink(f"/proc/{proc.pid}/exe")).name  # CMD itself
        servers = _holders(port)
        assert [_readlink(Path(f"/proc/{pid}/exe")) for pid in servers] == [
            str(guest_dir / RELAY_BINARY)
        ]
    finally:
        proc.kill()
        proc.wait(10)
        for pid in _holders(port):  # the detached server, whatever it runs
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _holders(port: int) -> list[int]:
    """The pids holding the socket listening on 127.0.0.1:``port``."""
    return [
        int(p.name) for p in Path("/proc").iterdir()
        if p.name.isdigit() and _listening_inodes_of(int(p.name), port)
    ]  # fmt: skip


def _readlink(p: Path) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return ""


def _listening_inodes_of(pid: int, port: int) -> str:
    """``str(port)`` if ``pid`` holds the socket listening on 127.0.0.1:``port``, else ""."""
    want = f"0100007F:{port:04X}"
    rows = (ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:])
    inodes = {f[9] for f in rows if f[1] == want and f[3] == "0A"}
    try:
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return ""
    return str(port) if any(f"socket:[{i}]" in fds for i in inodes) else ""
