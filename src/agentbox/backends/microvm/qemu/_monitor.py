"""The monitor of a detached microVM: our conmon, a small process that outlives its launcher.

:meth:`~agentbox.backends.microvm.qemu._detach.QemuDetached.launch` starts this module as
``__main__`` (:func:`~agentbox.backends.microvm.qemu._records.monitor_argv`) born outside the
launcher (its own session, and outside the launcher's unit cgroups, see
:func:`~agentbox.backends.microvm.qemu._records.born_outside`), hands it the request on
its stdin (a pipe: the spec's environment holds the gateway token and never
touches the disk) and returns once the VM runs. The monitor then does what an
attached ``run()`` does, with nobody attached:

1. boots (or restores) the VM (:meth:`~agentbox.backends.microvm.qemu.QemuBackend.create`):
   its jailed QEMU is the monitor's child, so it too is outside the launcher's
   process group and unit cgroups; the VM dir's ``owner`` names the monitor;
2. records itself and the VMM (pid and start time, sealed; see
   :mod:`~agentbox.backends.microvm.qemu._records`) so a new launcher can verify both;
3. runs the main command and holds the guest channel all along: the guest
   agent never loses its host, the gateway streams keep flowing (one
   gateway-socket connection per stream, as in an attached run), and the VM's
   deadline timer kills it at ``spec.deadline`` whether or not a launcher lives;
   the guest agent's token never leaves this process's memory;
4. writes the guest's output to the caller's log in the k8s-file format
   (:mod:`agentbox.backends._k8slog`), each record at most :data:`RECORD_BYTES`
   of content, the whole file capped at :data:`~agentbox.backends.base.MAX_LOG_BYTES`
   (the *first* part is kept; one note marks the cut). Every byte is the
   guest's (hostile): it is framed by us, never parsed here;
5. saves ``/workspace`` into ``spec.workspace`` (from the live guest, or off the
   dead guest's disk in userspace), destroys the VM (verified), and only then
   writes the exit marker ``<log>.exit``: a follower that sees the marker and no
   monitor may collect at once.

It lives as long as its VM, one per task, so it imports only what it runs with (issue
15): ``rich`` is kept out (:data:`~agentbox.backends.microvm.qemu._records.MONITOR_BLOCKED`),
and ``tests/unit/test_qemu_monitor_lean.py`` lists what it may not import.

A monitor killed midway leaves no marker: the follower then settles the VM as a
dead owner's (:func:`~agentbox.backends.microvm.qemu.recover_sandbox`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentbox.backends._k8slog import format_record, write_exit
from agentbox.backends.base import MAX_LOG_BYTES, Exited, SandboxSpec
from agentbox.backends.microvm._snapram import adopt_ram
from agentbox.backends.microvm.qemu import QemuBackend
from agentbox.backends.microvm.qemu import _records as detach
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, GuestError

log = get_logger(__spec__.name if __spec__ else __name__)

#: Content bytes per k8s-file record at most (conmon's read buffer: 8 KiB).
RECORD_BYTES = 8192
_NOTE = b"[agentbox: output past this point dropped: log cap reached]"


class LogWriter:
    """Appends the guest's output to a k8s-file log, thread-safe, capped at ``cap`` bytes."""

    def __init__(self, path: Path, cap: int = MAX_LOG_BYTES) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600)
        self._cap = cap
        self._written = 0
        self._full = False
        self._lock = threading.Lock()

    def write(self, stream: str, data: bytes) -> None:
        """One chunk of ``stream`` (stdout/stderr): split at newlines and every
        :data:`RECORD_BYTES`; dropped past the cap (the cut noted once)."""
        records = []
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:
                break
            pieces = [line[j : j + RECORD_BYTES] for j in range(0, len(line), RECORD_BYTES)]
            pieces = pieces or [b""]
            for k, piece in enumerate(pieces):
                whole = not last and k == len(pieces) - 1
                records.append(format_record(stream, piece, partial=not whole))
        with self._lock:
            for rec in records:
                if self._full:
                    return
                if self._written + len(rec) > self._cap:
                    self._full = True
                    os.write(self._fd, format_record("stderr", _NOTE, partial=False))
                    return
                os.write(self._fd, rec)
                self._written += len(rec)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _run(req: dict[str, Any]) -> int:
    settings = req["settings"]
    spec: SandboxSpec = req["spec"]
    argv: Sequence[str] = req["argv"]
    out_log = Path(req["log"])
    cold, accel, rootfs = req["backend"]
    backend = QemuBackend(settings, cold=cold, accel=accel, rootfs=rootfs)
    if req.get("ram") and not adopt_ram(req["ram"]):
        log.info("snapshot RAM of the launcher gone: loading it", sandbox=spec.name)
    me = detach.Identity.of(os.getpid())
    detach.write_record(settings, spec, log=out_log, monitor=me, vm=None)
    try:
        sb = backend.create(spec)
    except BaseException as exc:
        log.error("the VM did not start", sandbox=spec.name, error=str(exc))
        detach.drop_record(settings, spec.name)
        print(f"agentbox: could not start: {exc}", file=sys.stderr, flush=True)
        return 1
    writer = LogWriter(out_log)
    exited = Exited(-1, False)
    try:
        vmm = detach.Identity.of(sb.vm.vmm_pid())
        detach.write_record(settings, spec, log=out_log, monitor=me, vm=(sb.name, vmm))
        log.info("running detached", sandbox=spec.name, vm=sb.name, vmm=vmm.pid)
        left = max(1.0, sb.deadline_at - time.monotonic())
        try:
            res = sb.exec(
                argv,
                timeout=left,
                on_stdout=lambda b: writer.write("stdout", b),
                on_stderr=lambda b: writer.write("stderr", b),
            )
            code, timed_out = res.exit_code, res.timed_out or sb.timed_out
        except GuestError as exc:
            if sb.alive():
                raise
            # Killed from outside (a cancel, the follower's deadline kill, a crash).
            writer.write("stderr", f"agentbox: the VM died: {exc}\n".encode())
            code, timed_out = 137, sb.timed_out
        exited = Exited(code, timed_out)
        if spec.workspace is not None:
            sb.sync_workspace()  # off the dead guest's disk if it was killed
    except AgentboxError as exc:
        log.error("the detached run failed", sandbox=spec.name, error=str(exc))
        writer.write("stderr", f"agentbox: {exc}\n".encode())
        with contextlib.suppress(AgentboxError):
            if spec.workspace is not None:
                sb.sync_workspace()
    finally:
        writer.close()
        try:
            sb.destroy()
        finally:
            write_exit(out_log, exited)  # last: the follower's sign that all is done
    log.info("ended", sandbox=spec.name, exit_code=exited.exit_code, timed_out=exited.timed_out)
    return 0


def main() -> int:
    """Read the pickled request from stdin (a pipe from the launcher, root's), run it."""
    data = sys.stdin.buffer.read()
    sys.stdin.close()
    req = pickle.loads(data)  # noqa: S301 - written by our own launcher on a private pipe
    if not isinstance(req, dict):
        return 2
    return _run(req)


if __name__ == "__main__":
    sys.exit(main())
