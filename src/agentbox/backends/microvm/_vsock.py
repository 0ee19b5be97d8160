"""The host end of Firecracker's hybrid vsock: a unix socket, ``CONNECT <port>``, ``OK <n>``.

Firecracker exposes the guest's virtio-vsock device on the host as one unix
socket (the ``uds_path`` of its ``vsock`` config). A host process connects to
it, writes ``CONNECT <port>\\n`` and reads one line back: ``OK <host port>\\n``
once the guest accepted on ``<port>``; if nothing listens there yet, Firecracker
just closes the connection. From then on the socket is a plain byte stream to
the guest, which :class:`~agentbox.backends.microvm._channel.Channel` takes over.

The socket belongs to the VMM (it lives in the jail the VMM owns), so its
answer is untrusted: the reply is read one byte at a time up to
:data:`MAX_REPLY` bytes (never past the newline, so no guest byte that follows
it is swallowed), must match ``OK <decimal>`` exactly, and anything else fails
at once instead of being retried.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import GuestError, SandboxError

log = get_logger(__name__)

#: Longest reply accepted, newline included (``OK 4294967295\n`` is 14 bytes).
MAX_REPLY = 32
#: Seconds one attempt may wait for Firecracker's reply before it is retried.
HANDSHAKE_TIMEOUT = 5.0
_OK = re.compile(rb"OK ([0-9]{1,10})\n")


class _NotYet(Exception):
    """The guest does not listen yet (or the socket is not there yet): try again."""


def handshake(uds: Path, port: int, *, timeout: float, name: str = "") -> tuple[socket.socket, int]:
    """One attempt: connect to ``uds``, ask for guest ``port``; (socket, host port).

    Raises ``_NotYet`` when the attempt may be repeated (no socket, refused,
    closed without a reply, no reply in ``timeout``) and :class:`GuestError`
    for a reply that breaks the protocol.
    """
    if not 0 < port < 1 << 32:
        raise SandboxError(f"vsock port {port} out of range", sandbox=name or None)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.01, timeout))
        try:
            _connect(sock, uds)
            sock.sendall(f"CONNECT {port}\n".encode())
            reply = _read_line(sock, name)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise _NotYet(f"{uds}: {exc.strerror}") from None
        except (TimeoutError, ConnectionResetError, BrokenPipeError) as exc:
            raise _NotYet(f"no answer from {uds}: {exc}") from None
        except OSError as exc:
            raise SandboxError(f"cannot connect to {uds}: {exc}", sandbox=name or None) from exc
        if not reply:
            raise _NotYet(f"nothing listens on guest vsock port {port} yet")
        m = _OK.fullmatch(reply)
        if m is None:
            raise GuestError(
                f"bad vsock handshake reply from {uds}: {reply[:MAX_REPLY]!r}", sandbox=name or None
            )
        host_port = int(m.group(1))
        if host_port >= 1 << 32:
            raise GuestError(
                f"vsock handshake: host port {host_port} out of range", sandbox=name or None
            )
        sock.settimeout(None)
        return sock, host_port
    except BaseException:
        sock.close()
        raise


#: sun_path holds 108 bytes; a jail path deep in the data dir can be longer.
_SUN_PATH_MAX = 100


def _connect(sock: socket.socket, uds: Path) -> None:
    """Connect to ``uds``, through ``/proc/self/fd/<dir>/`` when its path is too long."""
    if len(os.fsencode(uds)) <= _SUN_PATH_MAX:
        sock.connect(str(uds))
        return
    try:
        dirfd = os.open(uds.parent, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise FileNotFoundError(exc.errno, exc.strerror, str(uds.parent)) from exc
    try:
        sock.connect(f"/proc/self/fd/{dirfd}/{uds.name}")
    finally:
        os.close(dirfd)


def _read_line(sock: socket.socket, name: str) -> bytes:
    """Bytes up to and including the first newline; b"" if closed before any byte."""
    buf = bytearray()
    while len(buf) < MAX_REPLY:
        b = sock.recv(1)
        if not b:
            if buf:
                raise GuestError(
                    f"vsock handshake: connection closed mid-reply {bytes(buf)!r}",
                    sandbox=name or None,
                )
            return b""
        buf += b
        if b == b"\n":
            return bytes(buf)
    raise GuestError(
        f"vsock handshake reply longer than {MAX_REPLY} bytes: {bytes(buf)!r}", sandbox=name or None
    )


def connect_vsock(
    uds: Path,
    port: int,
    *,
    timeout: float,
    name: str = "",
    alive: Callable[[], bool] | None = None,
    interval: float = 0.01,
) -> socket.socket:
    """A connected stream to guest vsock ``port`` through Firecracker's socket ``uds``.

    Retries (every ``interval`` seconds) until the guest listens, the VMM died
    (``alive`` returns False: :class:`SandboxError`) or ``timeout`` passed
    (:class:`GuestError`, naming the last reason). A reply that breaks the
    handshake fails at once.
    """
    deadline = time.monotonic() + timeout
    attempts = 0
    last = "never tried"
    while True:
        attempts += 1
        left = deadline - time.monotonic()
        try:
            sock, host_port = handshake(
                uds, port, timeout=min(HANDSHAKE_TIMEOUT, max(left, 0.01)), name=name
            )
        except _NotYet as exc:
            last = str(exc)
        else:
            log.debug("vsock connected", sandbox=name, port=port, host_port=host_port,
                      attempts=attempts)  # fmt: skip
            return sock
        if alive is not None and not alive():
            raise SandboxError(f"the VMM exited before the guest agent listened ({last})",
                               sandbox=name or None)  # fmt: skip
        if time.monotonic() >= deadline:
            raise GuestError(
                f"guest never accepted vsock port {port} within {timeout:g}s "
                f"({attempts} attempts; last: {last})",
                sandbox=name or None,
            )
        time.sleep(interval)
