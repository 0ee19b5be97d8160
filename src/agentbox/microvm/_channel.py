"""The host end of the guest agent's channel: frames over the virtio-serial socket.

One reader thread parses what the guest sends, defensively: an unknown frame
type, an oversized frame, a control message that is not a JSON object, or more
queued control messages than :data:`MAX_QUEUED` marks the channel broken, and
``on_broken`` (the VM's kill) runs. Every wait has a timeout. The guest is
never trusted to be well-behaved; it only gets to be slow, and then it is
killed.
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

from agentbox._log import get_logger
from agentbox.errors import GuestError
from agentbox.guest.agent import (
    CTRL,
    MAX_PAYLOAD,
    FrameReader,
    ProtocolError,
    decode_ctrl,
    encode_ctrl,
    encode_frame,
)

__all__ = ["Channel", "DataHandler", "GuestTimeout"]

log = get_logger("microvm.channel")

#: Control messages queued per stream before the guest counts as flooding.
MAX_QUEUED = 4096
#: A send the guest does not drain within this many seconds breaks the channel.
SEND_TIMEOUT = 60.0

DataHandler = Callable[[int, bytes], None]
"""Called in the reader thread with (frame type, payload) for a stream's data frames."""

_CLOSED: dict[str, Any] = {"op": "__closed__"}


class GuestTimeout(GuestError):
    """The guest did not answer in time (the channel itself may still be fine)."""


class Channel:
    """Multiplexed streams over one connected socket to the guest agent."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        on_broken: Callable[[str], None] | None = None,
        on_gateway_open: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self._sock = sock
        # Blocking for the reader; sends are non-blocking per call (MSG_DONTWAIT) with
        # their own deadline, so a guest that stops reading cannot wedge the host.
        self._sock.settimeout(None)
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._ctrl: dict[int, queue.Queue[dict[str, Any]]] = {0: queue.Queue(MAX_QUEUED)}
        self._data: dict[int, DataHandler] = {}
        self._next = 2
        self._on_broken = on_broken
        self._on_gateway_open = on_gateway_open
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
            self._ctrl[sid] = queue.Queue(MAX_QUEUED)
            if handler is not None:
                self._data[sid] = handler
        return sid

    def accept_stream(self, sid: int, handler: DataHandler) -> None:
        """Register a guest-opened (odd) stream."""
        with self._lock:
            self._ctrl[sid] = queue.Queue(MAX_QUEUED)
            self._data[sid] = handler

    def close_stream(self, sid: int) -> None:
        """Forget a stream; later frames for it are dropped."""
        with self._lock:
            self._ctrl.pop(sid, None)
            self._data.pop(sid, None)

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
                msg = q.get(timeout=timeout)
            except queue.Empty:
                raise GuestTimeout(
                    f"guest did not answer {sorted(ops)} within {timeout:g}s", sandbox=self.name
                ) from None
            if msg is _CLOSED:
                q.put(msg)
                raise GuestError(f"channel closed: {self.error}", sandbox=self.name)
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
            msg = decode_ctrl(payload)
            if msg["op"] == "gw_open" and stream % 2 == 1 and self._on_gateway_open:
                self._on_gateway_open(stream)
                return
            q = self._ctrl.get(stream)
            if q is None:
                return  # a stream we no longer listen to
            try:
                q.put_nowait(msg)
            except queue.Full:
                raise GuestError("guest floods control messages") from None
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
        self._closed.set()
        for q in queues:
            with contextlib.suppress(queue.Full):
                q.put_nowait(_CLOSED)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        log.debug("channel broken", sandbox=self.name, why=why)
        if self._on_broken is not None:
            self._on_broken(why)

    @property
    def broken(self) -> bool:
        """True once the channel failed or was closed."""
        return self.error is not None

    def close(self) -> None:
        """Close the channel; idempotent."""
        self._break("closed by host")
        with contextlib.suppress(OSError):
            self._sock.close()
