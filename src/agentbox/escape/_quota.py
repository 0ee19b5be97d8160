"""Kernel counters: a sandbox spends one until refused; can root still spend it?

The kernel charges inotify instances, POSIX message-queue bytes and queued
signals to the owner of the sandbox's user namespace as well (root, under
podman); see :mod:`agentbox.backends.oci._userns_limits`. Native AIO events come
from one host-wide counter (``fs.aio-max-nr``). For each counter the
sandbox runs the probe program with ``--exhaust KIND --hold S`` while a thread
of this (root) process tries, every few milliseconds, to spend one unit of the
same counter itself. Confinement holds when root never got refused.

The watcher works in-process (ctypes): an inotify instance opened and closed; a
one-message queue created and unlinked; a real-time signal queued to the
watcher's own thread (blocked there) and taken back with ``sigtimedwait``; a
one-event AIO context set up and destroyed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.linux.libc import libc

#: Counter -> the host probe id that reports it.
KINDS = {
    "inotify": "host.quota_inotify",
    "mqueue": "host.quota_mqueue",
    "sigpending": "host.quota_sigpending",
    "aio": "host.quota_aio",
}
_SYS_RT_TGSIGQUEUEINFO = 297
_SYS_GETTID = 186
_SYS_IO_SETUP = 206
_SYS_IO_DESTROY = 207
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = libc()
        _libc.syscall.restype = ctypes.c_long
    return _libc


class _MqAttr(ctypes.Structure):
    _fields_ = [
        ("mq_flags", ctypes.c_long),
        ("mq_maxmsg", ctypes.c_long),
        ("mq_msgsize", ctypes.c_long),
        ("mq_curmsgs", ctypes.c_long),
        ("pad", ctypes.c_long * 4),
    ]


def root_limit(kind: str) -> int:
    """Root's own limit for ``kind`` on this host, in the units the sandbox spends."""
    if kind == "inotify":
        try:
            return int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        except (OSError, ValueError):
            return 8192
    if kind == "sigpending":
        return resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]
    if kind == "aio":
        try:
            return int(Path("/proc/sys/fs/aio-max-nr").read_text())
        except (OSError, ValueError):
            return 65536
    return 4096  # mqueue: the sandbox spends bytes, in queues of shrinking size


def exhaust_config(kind: str) -> dict[str, object]:
    """The probe program's config for ``--exhaust kind``: ask for root's limit plus a margin,

    so a sandbox nothing caps spends root's whole quota (the controls fire), and a
    sandbox nothing refuses (gVisor's Sentry) stops there instead of running out of memory.
    """
    return {"exhaust_max": root_limit(kind) + 64}


def _errno_name(n: int) -> str:
    return errno.errorcode.get(n, str(n))


def try_once(kind: str) -> str:
    """Spend one unit of ``kind`` as this process and give it back; "" or the errno name."""
    lib = _lib()
    if kind == "inotify":
        fd = lib.inotify_init1(os.O_CLOEXEC)
        if fd < 0:
            return _errno_name(ctypes.get_errno())
        os.close(fd)
        return ""
    if kind == "mqueue":
        lib.mq_open.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_MqAttr),
        ]  # fmt: skip
        name = f"/agentbox-quota-{os.getpid()}-{threading.get_ident()}".encode()
        attr = _MqAttr(0, 1, 64, 0)
        fd = lib.mq_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, ctypes.byref(attr))
        if fd < 0:
            return _errno_name(ctypes.get_errno())
        os.close(fd)
        lib.mq_unlink(name)
        return ""
    if kind == "sigpending":
        # Queued to this thread with the signal blocked here, then taken back: it is never
        # delivered (its default action would end the process).
        sig = signal.SIGRTMIN + 3
        info = (ctypes.c_int * 32)()
        info[0], info[2] = sig, -1  # si_signo, si_code = SI_QUEUE
        old = signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
        try:
            tid = int(lib.syscall(_SYS_GETTID))
            if lib.syscall(_SYS_RT_TGSIGQUEUEINFO, os.getpid(), tid, sig, info) != 0:
                return _errno_name(ctypes.get_errno())
            signal.sigtimedwait([sig], 1.0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return ""
    if kind == "aio":
        ctx = ctypes.c_ulong(0)
        if lib.syscall(_SYS_IO_SETUP, 1, ctypes.byref(ctx)) != 0:
            return _errno_name(ctypes.get_errno())
        lib.syscall(_SYS_IO_DESTROY, ctx)
        return ""
    raise ValueError(f"unknown counter {kind!r}")


@dataclass
class QuotaWatcher:
    """A thread that spends one unit of ``kind`` as root every ``interval`` seconds."""

    kind: str
    interval: float = 0.01
    tries: int = 0
    refused: int = 0
    first_error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin trying in a daemon thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"quota-{self.kind}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            e = try_once(self.kind)
            self.tries += 1
            if e:
                self.refused += 1
                self.first_error = self.first_error or e
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop trying (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
