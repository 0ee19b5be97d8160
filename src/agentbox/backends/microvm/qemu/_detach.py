"""Detached microVMs: the VM outlives its launcher and a new launcher re-adopts it.

:meth:`~QemuDetached.launch` starts the VM's **monitor**
(:mod:`agentbox.backends.microvm.qemu._monitor`, our conmon): a small process born in
its own session and outside the launcher's unit cgroups (:func:`born_outside`),
not a child of the launcher (``setsid -f``: its parent is init). The monitor
boots the VM (the jailed QEMU is its child), holds the guest channel, runs the
main command, enforces the deadline, writes the output to the caller's log
(k8s-file, capped), saves ``/workspace``, destroys the VM and only then writes
``<log>.exit``. So nothing of the launcher is attached to a running VM; the
VM's jail, channel socket and disks stay in ``<data_dir>/microvm/<vm>``.

The **record** ``<data_dir>/microvm-detached/<name>.json`` (0600 in a 0700 dir)
names the sandbox, its labels, the data dir, the log, the deadline and the
monitor's and the VMM's pid and start time, sealed with an HMAC under
``<data_dir>/detach.key`` (the key podman's seals use). :meth:`~QemuDetached.adoptable`
and :meth:`~QemuDetached.follow` trust a record only if its seal holds for this
data dir and its monitor is that very process (pid, start time, command line):
a record copied from another data dir, or a pid reused by another process, is
refused. :meth:`~QemuDetached.follow` streams the log from its start while the
monitor lives, kills the VM itself past the deadline (a second line behind the
monitor's timer), and once the monitor is gone returns the end it recorded. A
monitor that died midway (``kill -9``) leaves no record of the end: the VM is
then settled as a dead owner's (killed, ``/data`` saved into the workspace it
was made for) and the end is unknown (-1).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agentbox.backends._detached import check_launch
from agentbox.backends._k8slog import LogReader, exit_marker, read_exit, write_exit
from agentbox.backends.base import (
    OWNER_DATA_LABEL,
    Exited,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.microvm.qemu._records import (
    born_outside,
    drop_record,
    monitor_argv,
    monitor_of,
    read_record,
    record_path,
)
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError, SandboxGone

logger = get_logger(__name__)

#: How long launch() waits for the VM to run (a first snapshot template takes long).
LAUNCH_TIMEOUT = 900.0
#: The follower kills the VM this long past its deadline if the monitor has not.
DEADLINE_GRACE = 30.0


class QemuDetached:
    """Mixed into :class:`~agentbox.backends.microvm.qemu.QemuBackend`: the detached verbs."""

    settings: Settings
    cold: bool
    _accel: str
    _rootfs: tuple[Path, str] | None

    if TYPE_CHECKING:

        def check(self, spec: SandboxSpec) -> None: ...

        def ram_ref(self, spec: SandboxSpec) -> dict[str, object] | None: ...

    def detaches(self, runtime: str) -> bool:
        """True: a monitor process of ours, not the caller, holds the VM."""
        del runtime
        return True

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """Start the VM's monitor detached (see the module docstring); return once the VM
        runs the command. Output past :data:`~agentbox.backends.base.MAX_LOG_BYTES` is
        dropped (the first part is kept, the cut noted). A name with a live record is
        refused (``SandboxError``) and nothing of that sandbox is touched."""
        check_launch(argv, log)
        self.check(spec)
        spec = spec.replace(
            labels={**spec.labels, OWNER_DATA_LABEL: data_dir_label(self.settings.data_dir)}
        )
        rec_path = record_path(self.settings, spec.name)
        old = read_record(self.settings, spec.name)
        if old is not None and monitor_of(old) is not None:
            raise SandboxError("a sandbox of that name exists already", sandbox=spec.name)
        drop_record(self.settings, spec.name)
        for stale in (log, exit_marker(log)):
            stale.unlink(missing_ok=True)
        rec_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        out = rec_path.with_suffix(".log")
        req = {
            "settings": self.settings,
            "backend": (self.cold, self._accel, self._rootfs),
            "spec": spec,
            "argv": list(argv),
            "log": str(log),
        }
        try:  # the monitor maps this process's memfd of the snapshot RAM: one per launcher
            req["ram"] = self.ram_ref(spec)
        except (AgentboxError, OSError) as exc:
            logger.warning("snapshot RAM not shared", sandbox=spec.name, error=str(exc))
        args = born_outside(monitor_argv(), out)
        res = _proc.run(args, input=pickle.dumps(req), timeout=60)
        if "agentbox: could not enter" in res.stderr:
            logger.warning("monitor born in our cgroup", sandbox=spec.name, why=res.stderr)
        self._wait_running(spec.name, out)
        logger.info("launched", sandbox=spec.name)

    def _wait_running(self, name: str, out: Path) -> None:
        """Until the monitor records a running VM; raise with its log's tail if it ends
        (or never shows) first, killing what it may have started."""
        start = time.monotonic()
        seen = False
        while time.monotonic() < start + LAUNCH_TIMEOUT:
            rec = read_record(self.settings, name)
            if rec is not None and rec.get("vm") is not None:
                return
            if rec is not None and monitor_of(rec) is None:
                break  # it died booting
            if rec is None and (seen or time.monotonic() > start + 60):
                break  # it dropped its record (the VM failed), or never wrote one
            seen = seen or rec is not None
            time.sleep(0.05)
        self.kill_detached(name)
        drop_record(self.settings, name)
        tail = ""
        with contextlib.suppress(OSError):
            tail = out.read_text(errors="replace")[-2000:]
        raise SandboxError(f"the VM's monitor did not start it: {tail.strip()}", sandbox=name)

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Stream ``log`` from its start until the monitor has ended the VM; then remove
        what is left of it (its record and monitor log)."""
        rec = read_record(self.settings, name)
        if rec is not None and rec.get("log") != str(log):
            raise SandboxGone("its record names another log", sandbox=name)
        if rec is None:
            # No record: a follower before us saw the end (or none of ours by that name).
            ended = read_exit(log)
            if ended is None or record_path(self.settings, name).exists():
                raise SandboxGone("not a detached sandbox of this data dir", sandbox=name)
            with LogReader(log, on_stdout, on_stderr) as reader:
                reader.pump()
            return ended
        monitor = monitor_of(rec)
        killed = False
        with LogReader(log, on_stdout, on_stderr) as reader:
            while monitor is not None and monitor.is_running():
                reader.pump()
                started = rec.get("started")
                if started is None:  # still booting: the record gains the VM soon
                    rec = read_record(self.settings, name) or rec
                elif not killed and time.time() > float(started) + _deadline(rec) + DEADLINE_GRACE:
                    logger.warning("deadline passed and the VM runs; killing it", sandbox=name)
                    self.kill_detached(name)
                    killed = True
                with contextlib.suppress(psutil.Error):
                    if monitor.status() == psutil.STATUS_ZOMBIE:
                        break
                time.sleep(poll)
            with self._final(log):
                ended = read_exit(log)
                if ended is None:
                    ended = self._settle_dead_monitor(name, rec, log, killed)
                reader.pump()
                drop_record(self.settings, name)
                with contextlib.suppress(OSError):
                    record_path(self.settings, name).with_suffix(".log").unlink()
        logger.info("followed to its end", sandbox=name, exit_code=ended.exit_code)
        return ended

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Whether ``name`` has a record sealed for this data dir whose monitor is that
        very process (pid, start time, command line) and whose labels equal ``labels``."""
        try:
            rec = read_record(self.settings, name)
        except SandboxGone:
            return False
        if rec is None or monitor_of(rec) is None:
            return False
        have = rec["labels"]
        return all(have.get(k) == v for k, v in labels.items())

    def reap(self, name: str) -> list[str]:
        """A detached VM's monitor outlives its launcher: end it first (the VM killed,
        ``/data`` saved by the monitor), then reap as for any microVM."""
        ended = [name] if self.end_detached(name) else []
        return [*ended, *super().reap(name)]  # type: ignore[misc]

    def end_detached(self, name: str, timeout: float = 120.0) -> bool:
        """For a reap: if ``name`` runs detached, kill its VM and wait (bounded) for its
        monitor to save ``/data`` and end, then drop its record. Whether it did."""
        try:
            rec = read_record(self.settings, name)
        except SandboxGone:
            return False
        if rec is None:
            return False
        monitor = monitor_of(rec)
        if monitor is not None:
            logger.warning("reaping a detached VM", sandbox=name, monitor=monitor.pid)
            self.kill_detached(name)
            with contextlib.suppress(psutil.Error):
                monitor.wait(timeout)
        drop_record(self.settings, name)
        with contextlib.suppress(OSError):
            record_path(self.settings, name).with_suffix(".log").unlink()
        return True

    # -- internals

    def kill_detached(self, name: str) -> None:
        """Kill the VM of ``name`` (its monitor then saves /data and ends)."""
        from agentbox.backends.microvm.qemu import kill_sandbox

        kill_sandbox(self.settings, name)

    def _settle_dead_monitor(
        self, name: str, rec: Mapping[str, Any], log: Path, killed: bool
    ) -> Exited:
        """The monitor died before recording the end: settle the VM as a dead owner's."""
        from agentbox.backends.microvm.qemu import recover_sandbox

        logger.warning("the VM's monitor died; settling the VM", sandbox=name)
        with contextlib.suppress(AgentboxError):
            recover_sandbox(self.settings, name)
        started = rec.get("started")
        late = started is not None and time.time() >= float(started) + _deadline(rec)
        ended = Exited(137 if killed else -1, killed or late)
        write_exit(log, ended)
        return ended

    @contextlib.contextmanager
    def _final(self, log: Path) -> Iterator[None]:
        """One follower at a time settles the end (a lock file beside the log)."""
        lock = log.with_name(log.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _deadline(rec: Mapping[str, Any]) -> float:
    value = rec.get("deadline")
    return float(value) if isinstance(value, int | float) else 3600.0
