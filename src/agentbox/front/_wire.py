"""The front end's framing: one JSON object per message, after its 4-byte length.

Standard library only: the client imports it before anything else. The request
(client → server) carries the caller's file descriptors as ``SCM_RIGHTS``; the
replies (server → client) are ``{"hello": 1}`` (a waiter is listening: only then does
the client send its request), ``{"started": pid}`` or ``{"declined": reason}``, then
``{"exit": code}`` or ``{"signal": number}``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct

TYPE_CHECKING = False  # the client's start: no typing
if TYPE_CHECKING:
    from typing import Any

#: The largest request: argv (a task may be given inline) and the environment.
MAX_REQUEST = 8 << 20
#: stdin, stdout, stderr and the working directory.
MAX_FDS = 4
_LEN = struct.Struct(">I")


class WireError(Exception):
    """A message that is cut short, too long or not a JSON object."""


class RequestError(WireError):
    """A request that is not the client's shape."""


def send_message(sock: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    """``doc`` as one framed message; ``fds`` travel with its first byte."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = sock.sendmsg(
            [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        )
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise WireError("the connection ended inside a message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _decode(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise WireError("not a JSON object")
    return doc


def read_message(sock: socket.socket, limit: int = 4096) -> dict[str, Any] | None:
    """The next message, or None at a clean end of the connection (between messages)."""
    head = b""
    while len(head) < _LEN.size:
        chunk = sock.recv(_LEN.size - len(head))
        if not chunk:
            if head:
                raise WireError("the connection ended inside a message")
            return None
        head += chunk
    (size,) = _LEN.unpack(head)
    if size > limit:
        raise WireError(f"a message of {size} bytes (at most {limit})")
    return _decode(_recv_exact(sock, size))


def recv_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request and the descriptors that came with it (close-on-exec, ours to close).

    More descriptors than :data:`MAX_FDS`, or any other ancillary data, is refused
    (every descriptor received is closed first).
    """
    fds = array.array("i")
    space = socket.CMSG_SPACE(MAX_FDS * fds.itemsize)
    data, ancdata, flags, _ = sock.recvmsg(_LEN.size, space, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    received = list(fds)
    try:
        if flags & socket.MSG_CTRUNC or len(received) > MAX_FDS:
            raise WireError("too many file descriptors")
        if any(k != socket.SCM_RIGHTS for _, k, _ in ancdata):
            raise WireError("unexpected ancillary data")
        head = data + _recv_exact(sock, _LEN.size - len(data)) if len(data) < _LEN.size else data
        (size,) = _LEN.unpack(head)
        if size > MAX_REQUEST:
            raise WireError(f"a request of {size} bytes (at most {MAX_REQUEST})")
        return _decode(_recv_exact(sock, size)), received
    except BaseException:
        for fd in received:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
