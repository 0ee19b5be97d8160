"""A live microVM sandbox: the VM, the guest agent's session, the deadline, teardown.

:class:`QemuSandbox` talks to the guest only through its agent
(:class:`~agentbox.backends.microvm._guest.GuestSession`: a kernel and nonce check before
every command); it never asks which VMM runs the VM, so the firecracker
backend's sandbox is this one with another :class:`~agentbox.backends.microvm._vm.Vm`.
"""

from __future__ import annotations

import contextlib
import shutil
import stat
import tarfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.base import (
    GATEWAY_SOCKET_NAME,
    HOME_IN_SANDBOX,
    WORKSPACE_IN_SANDBOX,
    BaseSandbox,
    ExecResult,
    OutputCallback,
    Posture,
    SandboxSpec,
)
from agentbox.backends.microvm import (
    Channel,
    GuestSession,
    Vm,
    export_disk,
    host_kernel,
    mount_label,
    wait_incoming,
    write_tar,
)
from agentbox.backends.microvm._recover import replace_workspace, vmm_uid
from agentbox.backends.microvm.qemu._posture import read_posture
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, GuestError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.microvm._base import _MicrovmBackend

log = get_logger(__name__)

BOOT_TIMEOUT = 180.0
#: Extra host sockets of a gateway dir the guest serves (the egress proxy's), at most.
_MAX_SOCKETS = 4
_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": HOME_IN_SANDBOX,
    "LANG": "C.UTF-8",
    "USER": "agent",
}

#: Seconds destroy() waits for a killed VMM's cgroups to become removable.
CGROUP_SETTLE = 30.0


class QemuSandbox(BaseSandbox):
    """A live microVM sandbox; ``destroy`` is idempotent and verifies nothing is left."""

    def __init__(
        self,
        backend: _MicrovmBackend,
        spec: SandboxSpec,
        vm: Vm,
        vm_dir: Path,
        *,
        restored: bool,
        forked: tuple[int, int] | None = None,
        ram_in_stream: bool = False,
    ) -> None:
        """``forked``: restored from another live VM's state (:mod:`.._fork`), whose
        session had opened streams up to (next host stream, last gateway stream);
        ``ram_in_stream``: that state carries its RAM (else a memfd holds it)."""
        self.backend = backend
        self.spec = spec
        self.vm = vm
        self.vm_dir = vm_dir
        super().__init__(vm.cfg.name)
        self.restored = restored
        self.forked = forked
        self.ram_in_stream = ram_in_stream
        self.session: GuestSession | None = None
        self.broken_reason: str | None = None
        self.deadline_at = time.monotonic() + spec.deadline
        self._watchdog = threading.Timer(spec.deadline, self._deadline_hit)
        self._watchdog.daemon = True
        self.timed_out = False
        self.boot_seconds = 0.0

    def _connect(self) -> None:
        t0 = time.monotonic()
        if self.restored:
            wait_incoming(self.vm, timeout=BOOT_TIMEOUT, ignore_shared=not self.ram_in_stream)
        sock = self.vm.connect(BOOT_TIMEOUT)
        first, last_gw = self.forked or (2, -1)
        chan = Channel(sock, name=self.name, on_broken=self._on_broken, first_stream=first,
                       last_gw=last_gw)  # fmt: skip
        session = GuestSession(chan, name=self.name, host=host_kernel())
        chan._on_gateway_open = session.on_gateway_open
        self.session = session
        if not self.restored:
            session.wait_ready(BOOT_TIMEOUT)
        gw = None
        if self.spec.gateway_dir is not None:
            gw = self.spec.gateway_dir / GATEWAY_SOCKET_NAME
        res = self.spec.resources
        labelled = [(mount_label(i), m) for i, m in enumerate(self.spec.mounts)]
        if self.forked is not None:  # greeted as its parent; its mounts are the parent's
            session.rekey(gateway=gw, timeout=BOOT_TIMEOUT,
                          sockets=_extra_sockets(self.spec.gateway_dir))  # fmt: skip
        else:
            session.hello(
                uid=self.spec.uid, mount_data=True, gateway=gw, timeout=BOOT_TIMEOUT,
                pids=res.pids, nofile=res.nofile,
                mounts=[(label, m.target) for label, m in labelled if m.read_only],
                cow=[(label, m.target) for label, m in labelled if not m.read_only],
                cow_size=res.disk_limit(self.backend.settings).size,
                sockets=_extra_sockets(self.spec.gateway_dir),
            )  # fmt: skip
        self.boot_seconds = time.monotonic() - t0
        # The deadline is the workload's: it starts once the guest is ready.
        self.deadline_at = time.monotonic() + self.spec.deadline
        self._watchdog.start()

    def _on_broken(self, why: str) -> None:
        # A guest that breaks the protocol (or dies) is killed; its /data disk stays
        # until destroy so partial results can still be collected.
        if not self._destroyed and "closed by host" not in why:
            self.broken_reason = why
            log.warning("guest channel broken, killing VM", sandbox=self.name, why=why)
            self.vm.terminate()

    def _deadline_hit(self) -> None:
        self.timed_out = True
        log.warning("sandbox deadline hit, killing VM", sandbox=self.name)
        self.vm.terminate()

    def alive(self) -> bool:
        """Whether the VMM still runs and the channel is healthy."""
        return self.vm.alive() and self.session is not None and not self.session.channel.broken

    def _session(self) -> GuestSession:
        if self.session is None or self._destroyed:
            raise SandboxError("sandbox is destroyed", sandbox=self.name)
        if not self.alive():
            raise GuestError(f"VM is gone: {self.broken_reason or 'VMM exited'}", sandbox=self.name)
        return self.session

    # -- Protocol
    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``argv`` as the sandbox uid after the per-command kernel and nonce check."""
        if not argv:
            raise SandboxError("empty argv", sandbox=self.name)
        full_env = {**_BASE_ENV, **dict(self.spec.env), **dict(env or {})}
        left = self.deadline_at - time.monotonic()
        limit = left if timeout is None else min(timeout, left)
        try:
            return self._session().exec(
                argv, env=full_env, cwd=self.spec.workdir, uid=self.spec.uid,
                timeout=max(0.1, limit), stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr,
            )  # fmt: skip
        except GuestError:
            if self.timed_out:
                return ExecResult(137, timed_out=True)
            raise

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy a host file or directory into the guest at ``dest`` (made if missing)."""
        if not src.exists():
            raise SandboxError(f"copy_in: {src} does not exist", sandbox=self.name)
        parent, name = dest.rstrip("/").rsplit("/", 1) if "/" in dest.rstrip("/") else ("", dest)
        self._session().put_tar(_tar_chunks(src, name), parent or "/")

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy ``src`` out of the guest to ``dest`` through the safe path layer.

        Links are recreated when they point inside the copy, never followed;
        devices, FIFOs and sockets are skipped; setuid/setgid bits dropped.
        ``dest`` must not exist yet.
        """
        self._session().get_tar(src, lambda tf: write_tar(tf, dest))

    def sync_workspace(self) -> None:
        """Replace ``spec.workspace``'s content with the guest's ``/workspace``.

        From the live guest through its agent; from a dead guest (deadline,
        crash) by reading its ``/data`` disk in userspace, in a jail.
        """
        ws = self.spec.workspace
        if ws is None:
            return
        if self.alive():
            self._session().sync()
            # Links kept whatever they point to, as a bind-mounted workspace shows them
            # (a venv setup made links /usr/bin/python3); never followed on the host.
            replace_workspace(
                ws,
                lambda dest: self._session().get_tar(
                    WORKSPACE_IN_SANDBOX, lambda tf: write_tar(tf, dest, links="any")
                ),
            )
        else:
            self.vm.terminate()
            uid = vmm_uid(self.backend.settings, "strict")
            replace_workspace(ws, lambda dest: export_disk(self.vm_dir / "data.img", dest, uid=uid))

    def posture(self) -> Posture:
        """Host-side facts read off the live VMM, and inside facts from the guest."""
        return read_posture(self)

    def host_pids(self) -> list[int]:
        """The VMM process: what a guest that broke out would become."""
        return [int(self.vm.vmm_pid())]

    def stop(self, timeout: float = 10.0) -> None:
        """Sync and power the guest off (kill after ``timeout``); the /data disk is kept."""
        if self.session is not None and self.alive():
            with contextlib.suppress(AgentboxError):
                self.session.sync(timeout)
            self.session.shutdown(timeout)
        self.vm.terminate()

    def _teardown(self) -> None:
        """Kill the VM, remove its cgroups, sockets and disks (once; see BaseSandbox)."""
        self._watchdog.cancel()
        if self.session is not None:
            self.session.channel.close()
        self.vm.kill()
        # A VMM with a GiB of guest RAM can take seconds to exit under load, longer than
        # one Cgroup.remove() waits: until it has, its cgroups cannot be removed. Wait
        # (bounded), as Firecracker's Microvm.kill() does, rather than leave them.
        cgroup, end = self.vm.cgroup, time.monotonic() + CGROUP_SETTLE
        while cgroup is not None and any(d.exists() for d in cgroup.dirs):
            if time.monotonic() > end:
                break  # leftovers() names them
            cgroup.remove()
        shutil.rmtree(self.vm_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """The VMM process, its cgroups, its socket dir or the VM dir, if still there."""
        left = []
        if self.vm.alive():
            left.append("the VMM process")
        if self.vm.cgroup is not None:
            left += [f"cgroup {d}" for d in self.vm.cgroup.dirs if d.exists()]
        left += [f"{what} {p}" for what, p in (("run dir", self.vm.cfg.run_dir),
                                               ("VM dir", self.vm_dir)) if p.exists()]  # fmt: skip
        return left


def _extra_sockets(gateway_dir: Path | None) -> dict[str, Path]:
    """The unix sockets in ``gateway_dir`` besides the gateway's (the egress proxy's
    ``egress.sock``): the guest serves each at ``/run/agentbox/gw/<name>``, as the
    container layout mounts the dir there."""
    if gateway_dir is None:
        return {}
    found: dict[str, Path] = {}
    for p in sorted(gateway_dir.iterdir()):
        if p.name == GATEWAY_SOCKET_NAME or not p.name.endswith(".sock"):
            continue
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(p.lstat().st_mode) and len(found) < _MAX_SOCKETS:
                found[p.name] = p
    return found


def _tar_chunks(src: Path, arcname: str) -> Iterator[bytes]:
    """A tar of ``src`` (as ``arcname``), in chunks; spooled so memory stays bounded."""
    import tempfile

    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tf:
            tf.add(src, arcname=arcname, recursive=True)
        spool.seek(0)
        while chunk := spool.read(1 << 18):
            yield chunk
