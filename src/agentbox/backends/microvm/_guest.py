"""A session with one guest agent: hello, the kernel check, exec, files (gateway streams:
:mod:`agentbox.backends.microvm._gwstreams`).

Before **every** command the host sends a fresh nonce and requires, within a
timeout: the HMAC of the nonce under this run's token (so the answer comes from
the agent this run greeted, after this boot or restore), and a kernel release
and boot id that both differ from the host's (so the command is about to run
on the guest's own kernel, not on a runtime that fell back to the host).

What the host holds for one guest is bounded, whatever the guest sends: per
gateway stream at most :data:`~agentbox.guest.wire.GW_WINDOW` bytes waiting
for the gateway (credit is granted back only as they drain; a guest that sends
past it breaks the channel), so :data:`MAX_GATEWAY_HELD` for all of them; the
channel's queued control messages (:data:`~agentbox.backends.microvm._channel.MAX_QUEUED_BYTES`);
a ``get`` stream's :data:`MAX_FILE_HELD`. Output of an ``exec`` without callbacks
is kept up to :data:`MAX_CAPTURE` per stream, the rest dropped.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import queue
import secrets
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._gwstreams import (
    GatewayStreams,
)
from agentbox.core.execution import ExecResult, OutputCallback
from agentbox.core.log import get_logger
from agentbox.errors import GuestError, GuestTimeout
from agentbox.guest.wire import FILE, MAX_PAYLOAD, STDERR, STDIN, STDOUT, proof

log = get_logger(__name__)

#: Output kept in memory per stream when no callback is given; the rest is dropped.
MAX_CAPTURE = 64 * 1024**2
CHECK_TIMEOUT = 30.0
#: Data frames of a ``get`` stream queued for its consumer (at most 4 MiB); when
#: full, the channel's reader waits, which stops the guest's sends.
FILE_FRAMES = 16
MAX_FILE_HELD = FILE_FRAMES * MAX_PAYLOAD
#: Exit codes a guest may report for a command; anything else is a protocol violation.
EXIT_CODES = range(-255, 256)


class KernelFacts:
    """A kernel release and boot id."""

    def __init__(self, release: str, boot_id: str) -> None:
        self.release = release
        self.boot_id = boot_id


def host_kernel() -> KernelFacts:
    """The host's own kernel release and boot id."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return KernelFacts(os.uname().release, boot_id)


class _Pipe:
    """A bounded byte queue the channel's reader fills and a consumer thread drains."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue(FILE_FRAMES)
        self.dead = False

    def put(self, data: bytes | None, timeout: float = 60.0) -> None:
        if self.dead:
            return
        try:
            self.q.put(data, timeout=timeout)
        except queue.Full:
            self.dead = True


class _StreamReader:
    """A file-like reader over a :class:`_Pipe` for ``tarfile.open(mode="r|")``."""

    def __init__(self, pipe: _Pipe, timeout: float) -> None:
        self.pipe = pipe
        self.buf = b""
        self.eof = False
        self.timeout = timeout

    def read(self, n: int = -1) -> bytes:
        while not self.eof and (n < 0 or len(self.buf) < n):
            try:
                chunk = self.pipe.q.get(timeout=self.timeout)
            except queue.Empty:
                raise GuestError("guest stopped sending a file stream") from None
            if chunk is None:
                self.eof = True
            else:
                self.buf += chunk
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


class GuestSession(GatewayStreams):
    """The host's side of the protocol with one guest agent."""

    def __init__(self, channel: Channel, *, name: str, host: KernelFacts) -> None:
        self.channel = channel
        self.name = name
        self.host = host
        self.token = secrets.token_hex(32)
        self.last_check: dict[str, Any] = {}
        self._init_streams()

    # -- session
    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait for the agent's ``ready`` after boot."""
        return self.channel.wait(0, {"ready"}, timeout)

    def hello(
        self,
        *,
        uid: int,
        mount_data: bool,
        gateway: Path | None,
        timeout: float,
        pids: int | None = None,
        nofile: int | None = None,
        mounts: Sequence[tuple[str, str]] = (),
        cow: Sequence[tuple[str, str]] = (),
        cow_size: int = 0,
        sockets: Mapping[str, Path] | None = None,
    ) -> None:
        """Greet the agent: token, clock, RNG seed, limits, mount /data, start the relay.

        ``mounts`` are (disk label, target) pairs the agent mounts read-only
        (``ro,nosuid,nodev``) before it answers, so before any command runs;
        ``cow`` are pairs it mounts copy-on-write (the disk read-only under an
        overlay whose writable layers live on the /data disk; ``cow_size``, the
        disk limit, is checked only: the disk bounds them).
        ``sockets`` maps names to host unix sockets: the guest serves each at
        ``/run/agentbox/gw/<name>`` and a connection there reaches that socket
        (as the gateway's port reaches ``gateway``).
        """
        self.gateway_socket = gateway
        self.sockets = dict(sockets or {})
        self.channel.send_ctrl({
            "op": "hello", "token": self.token, "uid": uid, "time": time.time(),
            "seed": secrets.token_hex(64), "mount_data": mount_data,
            "gateway": gateway is not None, "pids": pids, "nofile": nofile,
            "mounts": [{"label": label, "target": target} for label, target in mounts],
            "cow": [{"label": label, "target": target} for label, target in cow],
            "cow_size": cow_size, "sockets": sorted(self.sockets),
        })  # fmt: skip
        self._verify(self.channel.wait(0, {"hello_ok"}, timeout), nonce=None)
        self.channel.release_stream0()

    def rekey(
        self, *, gateway: Path | None, timeout: float, sockets: Mapping[str, Path] | None = None
    ) -> None:
        """Greet an agent restored from another live VM's state (a fork), greeted already:
        this session's own token, the clock and an RNG reseed (as :meth:`hello`), and the
        gateway relay if this sandbox has one; its mounts are its parent's."""
        self.gateway_socket = gateway
        self.sockets = dict(sockets or {})
        self.channel.send_ctrl({
            "op": "rekey", "token": self.token, "time": time.time(),
            "seed": secrets.token_hex(64), "gateway": gateway is not None,
        })  # fmt: skip
        self._verify(self.channel.wait(0, {"rekey_ok"}, timeout), nonce=None)
        self.channel.release_stream0()

    def set_clock(self, timeout: float = CHECK_TIMEOUT) -> None:
        """Set the guest's clock to the host's (after the VM was stopped a while)."""
        sid = self.channel.open_stream()
        try:
            self.channel.send_ctrl({"op": "clock", "time": time.time()}, sid)
            self.channel.wait(sid, {"clock_ok"}, timeout)
        finally:
            self.channel.close_stream(sid)

    def check(self, timeout: float = CHECK_TIMEOUT) -> dict[str, Any]:
        """The per-command check: nonce echoed under the token, a kernel that is not ours."""
        nonce = secrets.token_hex(16)
        sid = self.channel.open_stream()
        try:
            self.channel.send_ctrl({"op": "check", "nonce": nonce}, sid)
            msg = self.channel.wait(sid, {"check_ok"}, timeout)
        finally:
            self.channel.close_stream(sid)
        self._verify(msg, nonce=nonce)
        self.last_check = msg
        return msg

    def _verify(self, msg: dict[str, Any], *, nonce: str | None) -> None:
        release, boot_id = str(msg.get("release", "")), str(msg.get("boot_id", ""))
        if not release or not boot_id:
            raise GuestError("guest did not report its kernel", sandbox=self.name)
        if release == self.host.release or boot_id == self.host.boot_id:
            raise GuestError(
                f"guest reports the host's kernel ({release}, boot {boot_id}): refusing to run",
                sandbox=self.name,
            )
        if nonce is not None:
            want = proof(self.token, nonce)
            if msg.get("nonce") != nonce or not hmac.compare_digest(str(msg.get("proof")), want):
                raise GuestError("guest failed the nonce check", sandbox=self.name)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the agent to sync and power off (best effort)."""
        with contextlib.suppress(GuestError):
            sid = self.channel.open_stream()
            self.channel.send_ctrl({"op": "shutdown"}, sid)
            self.channel.wait(sid, {"bye"}, timeout)

    def sync(self, timeout: float = 60.0) -> None:
        """Flush the guest's page cache to its disks."""
        sid = self.channel.open_stream()
        try:
            self.channel.send_ctrl({"op": "sync"}, sid)
            self.channel.wait(sid, {"sync_ok"}, timeout)
        finally:
            self.channel.close_stream(sid)

    # -- exec
    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        uid: int,
        timeout: float | None,
        stdin: bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the guest after the kernel check; stream or capture its output."""
        self.check()
        out, err = bytearray(), bytearray()

        def handler(ftype: int, payload: bytes) -> None:
            cb, buf = (on_stdout, out) if ftype == STDOUT else (on_stderr, err)
            if ftype not in (STDOUT, STDERR) or not payload:
                return
            if cb is not None:
                cb(payload)
            elif len(buf) < MAX_CAPTURE:
                buf += payload[: MAX_CAPTURE - len(buf)]

        sid = self.channel.open_stream(handler)
        try:
            self.channel.send_ctrl({
                "op": "exec", "argv": list(argv), "env": dict(env), "cwd": cwd, "uid": uid,
                "stdin": stdin is not None,
            }, sid)  # fmt: skip
            if stdin is not None:
                self.channel.send(STDIN, sid, stdin)
                if stdin:
                    self.channel.send(STDIN, sid, b"")
            timed_out = False
            try:
                msg = self.channel.wait(sid, {"exit"}, timeout if timeout is not None else 1e9)
            except GuestTimeout:
                timed_out = True
                self.channel.send_ctrl({"op": "signal", "sig": 9}, sid)
                msg = self.channel.wait(sid, {"exit"}, 30.0)
            code = msg.get("code", 1)
            if type(code) is not int or code not in EXIT_CODES:
                # Handled like a crash: the VM is killed and its /data read off the disk.
                raise self.channel.violation(
                    f"exit code of type {type(code).__name__} outside -255..255"
                )
            if code < 0:
                code = 128 - code
            if msg.get("error"):
                err += f"agentbox: cannot exec {argv[0]}: {msg['error']}\n".encode()
            return ExecResult(code, bytes(out), bytes(err), timed_out=timed_out)
        finally:
            self.channel.close_stream(sid)

    # -- files
    def put_tar(self, chunks: Iterator[bytes], dest: str, timeout: float = 600.0) -> None:
        """Stream a tar archive into the guest, extracted at ``dest`` (owned by the sandbox uid)."""
        self.check()
        sid = self.channel.open_stream()
        try:
            self.channel.send_ctrl({"op": "put", "dest": dest}, sid)
            for chunk in chunks:
                if chunk:
                    self.channel.send(FILE, sid, chunk)
            self.channel.send(FILE, sid, b"")
            msg = self.channel.wait(sid, {"put_ok"}, timeout)
        finally:
            self.channel.close_stream(sid)
        if msg.get("error"):
            raise GuestError(
                f"copy into {dest} failed: {str(msg['error'])[:300]}", sandbox=self.name
            )

    def get_tar(
        self, src: str, consume: Callable[[tarfile.TarFile], object], timeout: float = 600.0
    ) -> None:
        """Stream ``src`` out of the guest as a tar and hand the open archive to ``consume``.

        ``consume`` must read it in stream order (``for member in tf``) and write
        through the safe path layer; it runs in the caller's thread.
        """
        self.check()
        pipe = _Pipe()

        def handler(ftype: int, payload: bytes) -> None:
            if ftype == FILE:
                pipe.put(payload if payload else None)

        sid = self.channel.open_stream(handler)
        try:
            self.channel.send_ctrl({"op": "get", "src": src}, sid)
            reader = _StreamReader(pipe, timeout=min(timeout, 120.0))
            fileobj: IO[bytes] = reader  # type: ignore[assignment]
            try:
                with tarfile.open(fileobj=fileobj, mode="r|") as tf:
                    consume(tf)
                while not reader.eof:  # drain the rest so the reader thread never stalls
                    reader.read(1 << 20)
            except tarfile.TarError as exc:
                raise GuestError(
                    f"guest sent a bad archive for {src}: {exc}", sandbox=self.name
                ) from exc
            finally:
                pipe.dead = True
            msg = self.channel.wait(sid, {"get_ok"}, timeout)
        finally:
            self.channel.close_stream(sid)
        if msg.get("error"):
            raise GuestError(
                f"copy out of {src} failed: {str(msg['error'])[:300]}", sandbox=self.name
            )
