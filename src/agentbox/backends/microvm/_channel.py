"""The host end of the guest agent's channel: frames over the virtio-serial socket.

One reader thread parses what the guest sends, defensively. Any of these marks
the channel broken, and ``on_broken`` (the VM's kill) runs:

- an unknown frame type, an oversized frame, a control message that is not a
  JSON object with an op (nesting too deep for the parser included);
- a control message on a stream nobody reads: stream 0 once the session is
  greeted, a gateway stream after its ``gw_open``, a ``gw_open`` that does not
  open a new (higher) odd stream, a host stream never opened. Only a late answer
  on a host stream the host already closed (it timed out) is dropped;
- queued control messages, across all streams, above :data:`MAX_QUEUED_BYTES`
  (counted as wire bytes plus :data:`MSG_OVERHEAD` each; they are kept as
  their raw bytes and parsed again when read, so what is held is what was sent);
- whatever a data handler rejects (a gateway stream sending past its credit).

Every wait has a timeout. The guest is never trusted to be well-behaved; it
only gets to be slow, and then it is killed.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from agentbox.core.log import get_logger
from agentbox.errors import GuestError, GuestTimeout
from agentbox.guest.wire import (
    CTRL,
    MAX_PAYLOAD,
    FrameReader,
    ProtocolError,
    decode_ctrl,
    encode_ctrl,
    encode_frame,
)

log = get_logger(__name__)

#: Control bytes queued for the host's readers, all streams together, before the
#: guest counts as flooding.
MAX_QUEUED_BYTES = 1024 * 1024
#: What one queued control message is charged beyond its payload (the bytes
#: object and the queue's slot), so a flood of tiny messages is bounded too.
MSG_OVERHEAD = 128
#: A send the guest does not drain within this many seconds breaks the channel.
SEND_TIMEOUT = 60.0

DataHandler = Callable[[int, bytes], None]
"""Called in the reader thread with (frame type, payload) for a stream's data frames.
It must not block; raising :class:`GuestError` breaks the channel."""


class Channel:
    """Multiplexed streams over one connected socket to the guest agent."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        on_broken: Callable[[str], None] | None = None,
        on_gateway_open: Callable[[int, str | None], None] | None = None,
        first_stream: int = 2,
        last_gw: int = -1,
    ) -> None:
        """``first_stream`` and ``last_gw``: for a guest restored from another live VM's
        state (a fork), past the streams that VM's session had opened, so what the
        guest still sends on those is dropped as late, never read as this session's."""
        self.name = name
        self._sock = sock
        # Blocking for the reader; sends are non-blocking per call (MSG_DONTWAIT) with
        # their own deadline, so a guest that stops reading cannot wedge the host.
        self._sock.settimeout(None)
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        # Raw control payloads per stream (None: the channel closed); stream 0 is
        # read until the session is greeted, see release_stream0().
        self._ctrl: dict[int, queue.Queue[bytes | None]] = {0: queue.Queue()}
        self._queued = 0  # bytes charged for everything in self._ctrl
        self._data: dict[int, DataHandler] = {}
        self._next = max(2, first_stream + first_stream % 2)
        self._last_gw = last_gw  # the highest gateway stream the guest opened
        self._on_broken = on_broken
        self._on_gateway_open = on_gateway_open
        self._close_hooks: list[Callable[[], None]] = []
        self.error: str | None = None
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"chan-{name}", daemon=True)
        self._reader.start()

    # -- streams
    def open_stream(self, handler: DataHandler | None = None) -> int:
        """A new host-side stream id, with a control queue and optional data handler."""
        with self._lock:
            sid = self._next
            self._next += 2
            self._ctrl[sid] = queue.Queue()
            if handler is not None:
                self._data[sid] = handler
        return sid

    def accept_stream(self, sid: int, handler: DataHandler) -> None:
        """Register a guest-opened (odd) stream's data handler (it has no control reader)."""
        with self._lock:
            self._data[sid] = handler

    def close_stream(self, sid: int) -> None:
        """Forget a stream; later data frames for it are dropped (see the module doc
        for control messages)."""
        with self._lock:
            q = self._ctrl.pop(sid, None)
            self._data.pop(sid, None)
            while q is not None:
                try:
                    raw = q.get_nowait()
                except queue.Empty:
                    break
                if raw is not None:
                    self._queued -= len(raw) + MSG_OVERHEAD

    def release_stream0(self) -> None:
        """The session is greeted: nothing reads stream 0 any more."""
        self.close_stream(0)

    def violation(self, why: str) -> GuestError:
        """Break the channel for a protocol violation found by a reader; the error to raise."""
        self._break(f"protocol violation: {why}")
        return GuestError(f"protocol violation: {why}", sandbox=self.name)

    @property
    def streams_seen(self) -> tuple[int, int]:
        """(the next host stream id, the highest gateway stream): what a fork's channel
        starts past (see ``first_stream``)."""
        with self._lock:
            return self._next, self._last_gw

    @property
    def queued_bytes(self) -> int:
        """Control bytes held for readers now (for tests and diagnostics)."""
        return self._queued

    # -- sending
    def send(self, ftype: int, stream: int, payload: bytes = b"") -> None:
        """Send data (split into frames); an empty payload is the stream's EOF."""
        frames = [payload[i : i + MAX_PAYLOAD] for i in range(0, len(payload), MAX_PAYLOAD)]
        self._write(b"".join(encode_frame(ftype, stream, f) for f in frames or [b""]))

    def send_ctrl(self, msg: dict[str, Any], stream: int = 0) -> None:
        """Send one control message."""
        self._write(encode_ctrl(msg, stream))

    def _write(self, data: bytes) -> None:
        if self.error is not None:
            raise GuestError(f"channel broken: {self.error}", sandbox=self.name)
        try:
            with self._wlock:
                self._sendall(data)
        except OSError as exc:
            self._break(f"send failed: {exc}")
            raise GuestError(f"channel send failed: {exc}", sandbox=self.name) from exc

    def _sendall(self, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + SEND_TIMEOUT
        while view:
            try:
                view = view[self._sock.send(view, socket.MSG_DONTWAIT) :]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"guest did not drain the channel for {SEND_TIMEOUT:g}s")
            select.select([], [self._sock], [], min(left, 1.0))

    # -- receiving
    def wait(self, stream: int, ops: set[str], timeout: float) -> dict[str, Any]:
        """The next control message on ``stream`` whose op is in ``ops``; others are skipped."""
        q = self._ctrl.get(stream)
        if q is None:
            raise GuestError(f"no stream {stream}", sandbox=self.name)
        while True:
            try:
                raw = q.get(timeout=timeout)
            except queue.Empty:
                raise GuestTimeout(
                    f"guest did not answer {sorted(ops)} within {timeout:g}s", sandbox=self.name
                ) from None
            if raw is None:
                q.put(raw)
                raise GuestError(f"channel closed: {self.error}", sandbox=self.name)
            with self._lock:
                self._queued -= len(raw) + MSG_OVERHEAD
            msg = decode_ctrl(raw)  # checked once already, when it arrived
            if msg["op"] in ops:
                return msg
            if msg["op"] == "error":
                raise GuestError(f"guest agent: {str(msg.get('error'))[:500]}", sandbox=self.name)

    def _read(self) -> None:
        reader = FrameReader()
        try:
            while True:
                try:
                    chunk = self._sock.recv(1 << 20)
                except OSError as exc:
                    self._break(f"recv failed: {exc}")
                    return
                if not chunk:
                    self._break("guest closed the channel")
                    return
                for ftype, stream, payload in reader.feed(chunk):
                    self._dispatch(ftype, stream, payload)
        except (ProtocolError, GuestError) as exc:
            self._break(f"protocol violation: {exc}")
        except Exception as exc:
            log.exception("channel reader failed", sandbox=self.name)
            self._break(f"reader failed: {exc}")

    def _dispatch(self, ftype: int, stream: int, payload: bytes) -> None:
        if ftype == CTRL:
            msg = decode_ctrl(payload)  # parsed to check it, then dropped (but a gw_open's "to")
            op = msg["op"]
            if stream % 2 == 1:
                if op != "gw_open" or stream <= self._last_gw or self._on_gateway_open is None:
                    raise GuestError(f"control message {op[:40]!r} on gateway stream {stream}")
                self._last_gw = stream
                to = msg.get("to")
                # Which host socket (None: the gateway's); the session checks the name.
                self._on_gateway_open(stream, to if isinstance(to, str) else None)
                return
            cost = len(payload) + MSG_OVERHEAD
            with self._lock:
                q = self._ctrl.get(stream)
                if q is None:
                    if 0 < stream < self._next:
                        return  # a late answer on a stream the host closed
                    raise GuestError(f"control message {op[:40]!r} on stream {stream}, unread")
                if self._queued + cost > MAX_QUEUED_BYTES:
                    raise GuestError(
                        f"guest floods control messages (over {MAX_QUEUED_BYTES} bytes queued)"
                    )
                self._queued += cost
                q.put_nowait(payload)
            return
        handler = self._data.get(stream)
        if handler is not None:
            handler(ftype, payload)

    def _break(self, why: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = why
            queues = list(self._ctrl.values())
            hooks, self._close_hooks = self._close_hooks, []
        self._closed.set()
        for q in queues:
            q.put_nowait(None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        log.debug("channel broken", sandbox=self.name, why=why)
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("channel close hook failed", sandbox=self.name)
        if self._on_broken is not None:
            self._on_broken(why)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once when the channel breaks or is closed (at once if it already is)."""
        with self._lock:
            if self.error is None:
                self._close_hooks.append(hook)
                return
        hook()

    @property
    def broken(self) -> bool:
        """True once the channel failed or was closed."""
        return self.error is not None

    def close(self) -> None:
        """Close the channel; idempotent."""
        self._break("closed by host")
        with contextlib.suppress(OSError):
            self._sock.close()
