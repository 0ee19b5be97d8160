"""The launcher's side of the gateway template (:mod:`._template`): start it, ask it.

One template per launcher process, started on the first gateway asked of it (the
setting ``gateway_template``) and kept until that process ends (it exits when its
socket closes). :func:`fork_gateway` hands it a task's descriptors and parameters
and returns the forked gateway as a :class:`ForkedProcess`; any failure (the
template would not start, died, refused or was late) raises :class:`GatewayError`,
and :func:`agentbox.gateway.spawn_gateway` falls back to exec'ing the gateway.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import GatewayError
from agentbox.gateway._template import FD_NAMES, own_posture

log = get_logger(__name__)

#: Seconds the template may take to import and say ready.
START_TIMEOUT = 30.0
#: Seconds one fork request may take.
REQUEST_TIMEOUT = 15.0
#: After a template failed to start, seconds before another is tried (exec meanwhile).
RETRY_AFTER = 60.0


class ForkedProcess:
    """A gateway forked by the template: what :class:`~agentbox.core.service.ServiceHandle`
    uses of a :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``returncode``).

    It is not this process's child, so it is watched through a pidfd (the very process,
    whatever its pid becomes later) and its exit status is not ours to read:
    ``returncode`` is None while it runs and 0 once it ended.
    """

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None
            self.returncode = 0

    def _ended(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], max(0.0, timeout))
        if readable:
            os.close(self._pidfd)
            self._pidfd = None
            self.returncode = 0
        return bool(readable)

    def poll(self) -> int | None:
        """None while it runs, else 0."""
        self._ended(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until it ended; :class:`subprocess.TimeoutExpired` past ``timeout``."""
        if not self._ended(3600.0 * 24 * 365 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return 0

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)  # type: ignore[arg-type]


class Template:
    """A running template process and the launcher's end of its socket; ``proc`` None
    for a channel to a template another process started (:func:`adopt_channel`)."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock
        self._lock = threading.Lock()

    @classmethod
    def start(cls, env: Mapping[str, str], *, prefix: Sequence[str] = ()) -> Template:
        """Start a template (``prefix``: what runs it, as :func:`enter_then_exec` makes)
        and wait for its ``ready``; GatewayError if it does not say so in time."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "agentbox.gateway._template", "--fd", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(
                [*prefix, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            raise GatewayError(f"cannot start the gateway template: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(START_TIMEOUT)
        try:
            said = ours.recv(64)
        except OSError as exc:
            said = f"{exc}".encode()
        if said != b"ready":
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            raise GatewayError(f"the gateway template did not start: {said[:64]!r}")
        ours.settimeout(REQUEST_TIMEOUT)
        log.info("gateway template started", pid=proc.pid)
        return cls(proc, ours)

    def alive(self) -> bool:
        """Whether the template process still runs (for a channel: not closed yet)."""
        if self.proc is None:
            return self._sock.fileno() >= 0
        return self.proc.poll() is None

    def channel(self) -> socket.socket:
        """A new channel to this template (its requests are answered as this one's are):
        what the front end's fork server gives each command. GatewayError on failure."""
        with self._lock:
            try:
                self._sock.send(b'{"channel": true}')
                fds = array.array("i")
                raw, anc, flags, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(4 * fds.itemsize))
            except OSError as exc:
                self.close()
                raise GatewayError(f"the gateway template failed: {exc}") from exc
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        if raw != b'{"channel": 1}' or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise GatewayError(f"the gateway template gave no channel: {raw[:200]!r}")
        sock = socket.socket(fileno=fds[0])
        sock.set_inheritable(False)
        sock.settimeout(REQUEST_TIMEOUT)
        return sock

    def fork(self, request: Mapping[str, object], fds: Sequence[int]) -> int:
        """Ask for one gateway; its pid. GatewayError when the template refuses or fails."""
        body = json.dumps(request).encode()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        with self._lock:
            try:
                self._sock.sendmsg([body], anc)
                raw = self._sock.recv(64 << 10)
            except OSError as exc:
                self.close()
                raise GatewayError(f"the gateway template failed: {exc}") from exc
        if not raw:
            self.close()
            raise GatewayError("the gateway template closed its socket")
        reply = json.loads(raw)
        if not isinstance(reply, dict) or not isinstance(reply.get("pid"), int):
            raise GatewayError(f"the gateway template refused: {str(reply.get('error'))[:300]}")
        return int(reply["pid"])

    def close(self) -> None:
        """Close our end (the template exits) and reap it; idempotent."""
        self._sock.close()
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_current: Template | None = None
_failed_at = 0.0


def current_template(env: Mapping[str, str], *, prefix: Sequence[str] = ()) -> Template:
    """This process's template, started now if none runs (GatewayError if it cannot be,
    and for :data:`RETRY_AFTER` seconds after such a failure)."""
    global _current, _failed_at
    with _lock:
        if _current is not None and _current.alive():
            return _current
        if _current is not None:
            proc = _current.proc
            log.warning("gateway template gone; starting another",
                        pid=proc.pid if proc else None,
                        code=proc.returncode if proc else None)  # fmt: skip
            _current.close()
            _current = None
        if time.monotonic() - _failed_at < RETRY_AFTER:
            raise GatewayError("the gateway template failed to start recently")
        try:
            _current = Template.start(env, prefix=prefix)
        except GatewayError:
            _failed_at = time.monotonic()
            raise
        return _current


def adopt_channel(sock: socket.socket) -> None:
    """Use ``sock``, a channel to a template another process started
    (:meth:`Template.channel`), as this process's template: a command forked by the
    front end's server, whose template is then the server's (one per service, already
    prepared), instead of one started for the command (~0.3 s of CPU on its path)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = Template(None, sock)


def stop_template() -> None:
    """Stop this process's template, if any (gateways it forked keep running)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
            _current = None


def fork_gateway(
    *,
    argv: Sequence[str],
    env: Mapping[str, str],
    secret_env: Mapping[str, str],
    listener: int,
    ready: int,
    log_fd: int,
    cgroups: Sequence[Path],
    template_env: Mapping[str, str],
    prefix: Sequence[str] = (),
) -> ForkedProcess:
    """Fork a gateway that runs as ``argv`` would (named so in ``/proc``), with ``env`` and
    ``secret_env`` (passed through a pipe only the gateway reads), the listening socket
    ``listener``, the ready pipe's write end ``ready`` and its log ``log_fd``; with what
    it would have inherited from this thread had this process exec'd it (mount
    namespace, nice value, CPU affinity, OOM score adjustment, limits, umask), which the
    template gives it or refuses (GatewayError: the caller then execs it)."""
    template = current_template(template_env, prefix=prefix)
    try:
        posture = own_posture()
        mntns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise GatewayError(f"cannot read this process's posture: {exc}") from exc
    secret_r, secret_w = -1, -1
    try:
        secret_r, secret_w = os.pipe2(os.O_CLOEXEC)
        data = json.dumps(dict(secret_env)).encode()
        if len(data) > 32 << 10:
            raise GatewayError("the gateway's secret environment is too large to pass")
        os.write(secret_w, data)
        os.close(secret_w)
        secret_w = -1
        fds = {"listener": listener, "ready": ready, "log": log_fd, "secrets": secret_r,
               "mntns": mntns}  # fmt: skip
        request = {"argv": list(argv), "env": dict(env), "cgroups": [str(p) for p in cgroups],
                   "posture": posture}  # fmt: skip
        pid = template.fork(request, [fds[name] for name in FD_NAMES])
    finally:
        os.close(mntns)
        for fd in (secret_r, secret_w):
            if fd >= 0:
                os.close(fd)
    forked = ForkedProcess(pid, argv)
    try:
        named = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        named = []
    if forked.poll() is not None or named != [a.encode() for a in argv]:
        raise GatewayError(f"the forked gateway (pid {pid}) ended before it was watched")
    return forked
