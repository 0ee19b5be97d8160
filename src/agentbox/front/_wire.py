"""The front end's framing: one JSON object per message, after its 4-byte length.

Standard library only: the client imports it before anything else. The request
(client → server) carries the caller's file descriptors as ``SCM_RIGHTS``; the
replies (server → client) are ``{"hello": 1}`` (a waiter is listening: only then does
the client send its request), ``{"started": pid}`` or ``{"declined": reason}``, then
``{"exit": code}`` or ``{"signal": number}``.
"""

from __future__ import annotations

import _socket
import os
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


#: JSON's escapes for what may not stand in a string as it is: the control characters,
#: the quote and the backslash. (A lone surrogate, as ``surrogateescape`` leaves in
#: ``os.environ`` and ``sys.argv``, cannot be UTF-8: :func:`encode` hands that to json.)
_ESCAPES = {c: f"\\u{c:04x}" for c in range(0x20)}
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t"})


def _dumps(value: object, out: list[str]) -> None:
    """``value`` as compact JSON (what ``json.dumps`` with ``(",", ":")`` means, non-ASCII
    as UTF-8), for the types a message holds; ``TypeError`` for any other."""
    if isinstance(value, str):
        out.append('"' + value.translate(_ESCAPES) + '"')
    elif value is None or value is True or value is False:
        out.append("null" if value is None else "true" if value else "false")
    elif type(value) is int:
        out.append(str(value))
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _dumps(item, out)
        out.append("]")
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"a key of type {type(key).__name__}")
            out.append(',"' if i else '"')
            out.append(key.translate(_ESCAPES) + '":')
            _dumps(item, out)
        out.append("}")
    else:
        raise TypeError(f"a value of type {type(value).__name__}")


def encode(doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON bytes, without importing :mod:`json` (25 % of the client's imports)."""
    out: list[str] = []
    try:
        _dumps(doc, out)
        return "".join(out).encode()
    except (TypeError, UnicodeEncodeError):  # a type not ours, a lone surrogate: as json says
        import json

        return json.dumps(doc, separators=(",", ":")).encode()


def send_message(sock: _socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    """``doc`` as one framed message; ``fds`` travel with its first byte."""
    body = encode(doc)
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = sock.sendmsg(
            [data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        )
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exact(sock: _socket.socket, n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise WireError("the connection ended inside a message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _decode(body: bytes) -> dict[str, Any]:
    # The replies the client waits for are one name and a number ({"hello":1},
    # {"started":PID}, {"exit":CODE}, {"signal":N}): read without importing json.
    name, sep, num = body[2:-1].partition(b'":')
    if (
        body[:2] == b'{"' and body[-1:] == b"}" and sep and name.isalpha() and name.isascii()
        and (num[1:] if num[:1] == b"-" else num).isdigit() and num.isascii() and len(num) < 20
    ):  # fmt: skip
        return {name.decode(): int(num)}
    import json

    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise WireError("not a JSON object")
    return doc


def read_message(sock: _socket.socket, limit: int = 4096) -> dict[str, Any] | None:
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


def recv_request(sock: _socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request and the descriptors that came with it (close-on-exec, ours to close).

    More descriptors than :data:`MAX_FDS`, or any other ancillary data, is refused
    (every descriptor received is closed first).
    """
    import array  # not at the top: it imports collections, the client's start

    fds = array.array("i")
    space = _socket.CMSG_SPACE(MAX_FDS * fds.itemsize)
    data, ancdata, flags, _ = sock.recvmsg(_LEN.size, space, _socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    received = list(fds)
    try:
        if flags & _socket.MSG_CTRUNC or len(received) > MAX_FDS:
            raise WireError("too many file descriptors")
        if any(k != _socket.SCM_RIGHTS for _, k, _ in ancdata):
            raise WireError("unexpected ancillary data")
        head = data + _recv_exact(sock, _LEN.size - len(data)) if len(data) < _LEN.size else data
        (size,) = _LEN.unpack(head)
        if size > MAX_REQUEST:
            raise WireError(f"a request of {size} bytes (at most {MAX_REQUEST})")
        return _decode(_recv_exact(sock, size)), received
    except BaseException:
        for fd in received:
            try:  # noqa: SIM105 (contextlib: the client's start)
                os.close(fd)
            except OSError:
                pass
        raise
