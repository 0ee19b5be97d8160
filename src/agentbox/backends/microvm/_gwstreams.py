"""Gateway streams of one guest: each guest connection to the gateway port (or to an
extra socket, the egress proxy's) carried over the channel to a host unix socket.

A guest opens a stream with ``gw_open`` (``to``: the name of an extra socket the
hello offered; none: the gateway). The host opens one connection to that socket
per stream (at most :data:`MAX_GATEWAY_STREAMS` at once) and copies both ways
with flow control: at most :data:`~agentbox.guest.wire.GW_WINDOW` bytes of a
stream wait for the socket, credit is granted back only as they drain, and a
guest that sends past it breaks the channel; so :data:`MAX_GATEWAY_HELD` for all.
:class:`GatewayStreams` is the part of :class:`~agentbox.backends.microvm._guest.GuestSession`
that does this.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from pathlib import Path

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._sockpath import connectable
from agentbox.core.log import get_logger
from agentbox.errors import GuestError
from agentbox.guest.wire import GW, GW_WINDOW

log = get_logger(__name__)

#: Gateway connections a guest may hold open at once; more are refused (EOF at once),
#: so a guest cannot make the host open sockets and threads without bound.
MAX_GATEWAY_STREAMS = 64
#: Bytes of guest-to-gateway data the host may hold for one VM, all streams (16 MiB).
MAX_GATEWAY_HELD = MAX_GATEWAY_STREAMS * GW_WINDOW


def _connect_unix(conn: socket.socket, path: Path, timeout: float) -> None:
    """Connect ``conn`` to ``path`` within ``timeout``.

    A unix socket whose accept backlog is full refuses a non-blocking connect at
    once (EAGAIN) instead of waiting: a burst of guest connections retries here.
    """
    deadline = time.monotonic() + timeout
    conn.settimeout(timeout)
    while True:
        try:
            with connectable(path) as where:
                conn.connect(where)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
    conn.settimeout(None)


class _Upstream:
    """One gateway stream's guest-to-gateway bytes, at most :data:`GW_WINDOW` held.

    The channel's reader puts (never blocks); the stream's writer thread gets,
    sends to the gateway and grants the guest the drained bytes back as credit.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.chunks: deque[bytes] = deque()
        self.received = 0  # bytes the guest sent on the stream
        self.allowed = GW_WINDOW  # bytes it may have sent: the window plus credit granted
        self.eof = False
        self.dead = False  # the gateway side failed: drop what comes

    def put(self, payload: bytes) -> None:
        with self.cond:
            if not payload:
                self.eof = True
            else:
                self.received += len(payload)
                if self.received > self.allowed:
                    raise GuestError(
                        f"guest sent {self.received - self.allowed} bytes past its gateway "
                        f"stream's credit (window {GW_WINDOW})"
                    )
                if not self.dead:
                    self.chunks.append(payload)
            self.cond.notify()

    def get(self) -> bytes | None:
        with self.cond:
            while not self.chunks and not self.eof:
                self.cond.wait()
            return self.chunks.popleft() if self.chunks else None

    def empty(self) -> bool:
        with self.cond:
            return not self.chunks

    def grant(self, n: int) -> None:
        with self.cond:
            self.allowed += n

    def fail(self) -> None:
        with self.cond:
            self.dead = True
            self.chunks.clear()

    @property
    def held(self) -> int:
        with self.cond:
            return sum(len(c) for c in self.chunks)


class GatewayStreams:
    """The gateway streams of one guest session (mixed into ``GuestSession``)."""

    channel: Channel
    name: str

    def _init_streams(self) -> None:
        self.gateway_socket: Path | None = None
        #: Extra host sockets the guest may open streams to, by name (the egress proxy's).
        self.sockets: dict[str, Path] = {}
        self._gw_open = 0
        self._gw_lock = threading.Lock()
        self._upstreams: dict[int, _Upstream] = {}
        self._gw_conns: set[socket.socket] = set()
        # A dead channel ends every gateway connection: the host keeps nothing for it.
        self.channel.on_close(self._close_gateway_streams)

    # called by the channel's reader for each guest connection
    def on_gateway_open(self, sid: int, to: str | None = None) -> None:
        """Open one connection to the gateway socket (or to extra socket ``to``, one the
        hello named; any other name gets its stream ended) for the guest's stream ``sid``."""
        gw = self.gateway_socket if to is None else self.sockets.get(to)
        conn: socket.socket | None = None
        with self._gw_lock:
            if self._gw_open >= MAX_GATEWAY_STREAMS:
                gw = None
                log.warning("guest exceeds the gateway stream limit", sandbox=self.name)
            elif gw is not None:
                self._gw_open += 1
        if gw is not None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                _connect_unix(conn, gw, timeout=5.0)
            except OSError as exc:
                log.warning("gateway connect failed", sandbox=self.name, error=str(exc))
                conn.close()
                conn = None
                with self._gw_lock:
                    self._gw_open -= 1
        if conn is None:
            with contextlib.suppress(GuestError):
                self.channel.send(GW, sid, b"")
            return
        up = _Upstream()

        def handler(ftype: int, payload: bytes) -> None:
            if ftype == GW:
                up.put(payload)

        with self._gw_lock:
            self._upstreams[sid] = up
            self._gw_conns.add(conn)
        self.channel.accept_stream(sid, handler)
        threading.Thread(target=self._gw_to_socket, args=(conn, up, sid), daemon=True).start()
        threading.Thread(target=self._gw_to_guest, args=(conn, sid), daemon=True).start()

    @property
    def gateway_held(self) -> int:
        """Guest-to-gateway bytes the host holds now, all streams (at most MAX_GATEWAY_HELD)."""
        with self._gw_lock:
            ups = list(self._upstreams.values())
        return sum(up.held for up in ups)

    def _gw_to_socket(self, conn: socket.socket, up: _Upstream, sid: int) -> None:
        # Credit goes back to the guest only for bytes the gateway took: when it stops
        # reading (uvicorn does, behind a pipelined request), the guest stops sending.
        drained = 0
        try:
            while (chunk := up.get()) is not None:
                conn.sendall(chunk)
                drained += len(chunk)
                if drained >= GW_WINDOW // 4 or up.empty():
                    up.grant(drained)  # before the guest can act on it
                    self.channel.send_ctrl({"op": "gw_credit", "n": drained}, sid)
                    drained = 0
            conn.shutdown(socket.SHUT_WR)
        except (OSError, GuestError):
            up.fail()

    def _gw_to_guest(self, conn: socket.socket, sid: int) -> None:
        try:
            while chunk := conn.recv(1 << 16):
                self.channel.send(GW, sid, chunk)
        except (OSError, GuestError):
            pass
        with contextlib.suppress(GuestError):
            self.channel.send(GW, sid, b"")
        with self._gw_lock:
            self._gw_open -= 1
            up = self._upstreams.pop(sid, None)
            self._gw_conns.discard(conn)
        conn.close()
        self.channel.close_stream(sid)
        if up is not None:
            up.fail()

    def _close_gateway_streams(self) -> None:
        with self._gw_lock:
            conns, ups = list(self._gw_conns), list(self._upstreams.values())
        for up in ups:
            up.fail()
            up.put(b"")  # wakes its writer
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
