"""One command in a running container over the Engine's exec API, streamed.

``POST /containers/{id}/exec`` then ``POST /exec/{id}/start`` hijacks the HTTP
connection: stdin is written to it (then half-closed), and the daemon sends the
command's output as frames (8-byte header: stream, 0, 0, 0, size). The exit code
is read with ``GET /exec/{id}/json``. Frames are untrusted sizes: bounded.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentbox.backends.base import OutputCallback
from agentbox.backends.docker._client import GuardedClient
from agentbox.errors import SandboxError

_MAX_FRAME = 16 * 1024 * 1024


class ExecOutcome:
    """Exit code (None: the daemon had none, the container died) and whether we gave up."""

    def __init__(self, exit_code: int | None, gave_up: bool) -> None:
        self.exit_code = exit_code
        self.gave_up = gave_up


def _raw(sock: Any) -> socket.socket:
    raw = getattr(sock, "_sock", sock)
    if not isinstance(raw, socket.socket):
        raise SandboxError(f"docker exec gave no socket ({type(raw).__name__})")
    return raw


#: How often a silent stream checks that its container still runs (a killed gVisor
#: container may leave the exec stream open: its shim holds the other end).
_POLL = 2.0


class _GaveUp(Exception):
    pass


class _Reader:
    """Reads the frame stream; a silent stream whose container died reads as EOF."""

    def __init__(self, raw: socket.socket, end: float | None, alive: Callable[[], bool]) -> None:
        self.raw, self.end, self.alive = raw, end, alive
        raw.settimeout(_POLL)

    def some(self, n: int) -> bytes:
        while True:
            try:
                return self.raw.recv(n)
            except TimeoutError:
                if self.end is not None and time.monotonic() > self.end:
                    raise _GaveUp from None
                if not self.alive():
                    return b""

    def exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.some(min(n - len(buf), 65536))
            if not chunk:
                break
            buf += chunk
        return bytes(buf)


def _feed(raw: socket.socket, data: bytes) -> None:
    """Send ``data`` then half-close (the command reads EOF); the reader's timeout stays."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[raw.send(view[:65536]) :]
            except TimeoutError:
                continue
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        return  # the stream is gone (the command exited without reading it all)


def exec_stream(
    client: GuardedClient,
    container: str,
    argv: Sequence[str],
    *,
    user: str,
    workdir: str,
    env: Mapping[str, str] | None,
    stdin: bytes | None,
    on_stdout: OutputCallback,
    on_stderr: OutputCallback,
    timeout: float | None,
) -> ExecOutcome:
    """Run ``argv`` in ``container``; output to the callbacks; ``timeout`` bounds the read."""
    try:
        made = client.api.exec_create(
            container,
            list(argv),
            stdout=True,
            stderr=True,
            stdin=stdin is not None,
            tty=False,
            privileged=False,
            user=user,
            environment=[f"{k}={v}" for k, v in (env or {}).items()],
            workdir=workdir,
        )
        exec_id = str(made["Id"])
        sock = client.api.exec_start(exec_id, socket=True, tty=False)
    except SandboxError:
        raise
    except Exception as exc:  # the SDK's APIError, requests' errors
        raise SandboxError(f"docker exec failed: {exc}", sandbox=container) from exc
    raw = _raw(sock)
    gave_up = False

    def alive() -> bool:
        try:
            state = client.api.inspect_container(container).get("State") or {}
        except Exception:  # gone
            return False
        return bool(state.get("Running")) if isinstance(state, dict) else False

    end = None if timeout is None else time.monotonic() + timeout
    reader = _Reader(raw, end, alive)
    feeder: threading.Thread | None = None
    try:
        if stdin is not None:
            # From a thread: a command that writes before it reads would otherwise
            # deadlock against us (both socket buffers full).
            feeder = threading.Thread(target=_feed, args=(raw, stdin), daemon=True)
            feeder.start()
        while True:
            head = reader.exactly(8)
            if len(head) < 8:
                break
            kind, size = struct.unpack(">BxxxL", head)
            if size > _MAX_FRAME:
                raise SandboxError(f"docker exec sent a frame of {size} bytes", sandbox=container)
            data = reader.exactly(size)
            (on_stderr if kind == 2 else on_stdout)(data)
            if len(data) < size:
                break
    except (_GaveUp, TimeoutError):
        gave_up = True
    except OSError as exc:
        raise SandboxError(f"docker exec stream: {exc}", sandbox=container) from exc
    finally:
        with contextlib.suppress(Exception):
            sock.close()  # the SDK's wrapper: it leaves the socket under it open
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)  # a feeder still sending fails now, and ends
        if feeder is not None:
            feeder.join(5)
        if feeder is None or not feeder.is_alive():  # never close an fd a thread still uses
            raw.close()
    try:
        info = client.api.exec_inspect(exec_id)
    except Exception:  # the container is gone (killed at its deadline)
        return ExecOutcome(None, gave_up)
    code = info.get("ExitCode")
    running = bool(info.get("Running"))
    return ExecOutcome(code if isinstance(code, int) and not running else None, gave_up)
