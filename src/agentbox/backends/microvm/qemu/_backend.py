"""The qemu backend: every sandbox a QEMU microVM with its own kernel and a confined VMM.

``QemuBackend(settings)`` boots sandboxes by restoring a snapshot of a guest
that booted once to a ready agent (made on first use, per image and VM
shape); ``QemuBackend(settings, cold=True)`` boots each one fresh. What it
shares with the firecracker backend (mount checks, the VM's shape, VM dirs,
``run`` and the verbs for a dead owner's sandbox) is
:class:`~agentbox.backends.microvm._base._MicrovmBackend`'s. See
docs/reference/qemu-backend.md and docs/explanation/microvm-isolation.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import Literal

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm import Vm, VmConfig, ensure_snapshot, snapshot_ram
from agentbox.backends.microvm._base import _MicrovmBackend
from agentbox.backends.microvm._fork import Frozen, fork_vm, freeze, start_fork
from agentbox.backends.microvm._recover import vmm_uid, write_owner
from agentbox.backends.microvm._snapram import ram_ref as _ram_ref
from agentbox.backends.microvm._snapshot import find_snapshot
from agentbox.backends.microvm.kvm import probe_kvm
from agentbox.backends.microvm.qemu._detach import QemuDetached
from agentbox.backends.microvm.qemu._sandbox import QemuSandbox
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError, UnsupportedError

log = get_logger(__name__)


@functools.cache
def _qemu_version(binary: str) -> str:
    try:
        return _proc.run([binary, "--version"], timeout=30).stdout.split("\n")[0]
    except AgentboxError:
        return "unknown"


class QemuBackend(QemuDetached, _MicrovmBackend):  # detached verbs: qemu/_detach.py
    """Makes QEMU microVM sandboxes (``name = "qemu"``)."""

    name = "qemu"
    #: What its VMM process's name contains (the resource sampler checks a record with it).
    vmm_process = "qemu"
    snapshots = True
    environments_refused: str | None = None  # the environment: a read-only disk under an overlay

    def __init__(
        self,
        settings: Settings,
        *,
        cold: bool = False,
        accel: Literal["auto", "kvm", "tcg"] = "auto",
        rootfs: tuple[Path, str] | None = None,
    ) -> None:
        """``cold`` boots every sandbox fresh instead of restoring the snapshot.

        ``rootfs`` (a root directory and its content hash) overrides the image
        lookup; ``accel="auto"`` uses KVM only where :func:`probe_kvm` booted a guest.
        """
        super().__init__(settings, cold=cold, rootfs=rootfs)
        self._accel = accel

    def accel(self) -> str:
        """``kvm`` if asked for or probed to work, else ``tcg``."""
        if self._accel != "auto":
            return self._accel
        return "kvm" if probe_kvm(self.settings).ok else "tcg"

    def check(self, spec: SandboxSpec) -> None:
        """Refuse what a microVM cannot honour, before anything starts."""
        fac = _host.qemu(self.settings.qemu_binary)
        if not fac.ok:
            raise UnsupportedError(fac.detail, fix=fac.fix)
        for tool in ("bwrap", "setpriv", "mkfs.ext4", "busybox"):
            if shutil.which(tool) is None:
                raise UnsupportedError(f"{tool} not found", fix="scripts/setup.sh")
        self._check_spec(spec)

    def _vm(self, cfg: VmConfig, vm_dir: Path) -> Vm:
        """QEMU in its jail (bwrap + setpriv) and cgroup, not started yet."""
        del vm_dir
        return Vm(cfg)

    def _start(self, vm: Vm) -> None:
        """Start QEMU: restoring the snapshot of a ready guest (made on first use for
        this VM shape) unless the backend is cold."""
        fd: int | None = None
        if not self.cold:
            snap = ensure_snapshot(
                self.settings.cache_dir, vm.cfg, _qemu_version(vm.cfg.qemu_binary)
            )
            vm.cfg.ram_fd = snapshot_ram(snap.ram, vm.cfg.memory_mib * 1024**2)
            fd = os.open(snap.state, os.O_RDONLY)
            vm.cfg.incoming_fd = fd
        try:
            vm.start()
        finally:
            if fd is not None:
                os.close(fd)

    def ram_ref(self, spec: SandboxSpec) -> dict[str, object] | None:
        """Where this process's memfd of ``spec``'s snapshot RAM is (see
        :func:`~agentbox.backends.microvm._snapram.ram_ref`), for a detached VM's
        monitor to share it; None when cold or that snapshot is not made yet."""
        if self.cold:
            return None
        cfg = self.base_config(spec, self.settings.data_dir, None)
        cfg = dataclasses.replace(cfg, mount_disks=tuple(Path() for _ in spec.mounts))
        snap = find_snapshot(self.settings.cache_dir, cfg, _qemu_version(cfg.qemu_binary))
        return None if snap is None else _ram_ref(snap.ram, cfg.memory_mib * 1024**2)

    # -- forks (Sandbox.fork: memory and disk; see microvm/_fork.py)
    def freeze(self, sb: object, into: Path) -> Frozen:
        """Save the live sandbox ``sb`` (a :class:`QemuSandbox`) for forks into ``into``
        (a fresh root-only dir under the data dir); ``sb`` runs on."""
        if not isinstance(sb, QemuSandbox):
            raise SandboxError("fork: not a qemu sandbox")
        return freeze(sb, into)

    def fork(self, spec: SandboxSpec, frozen: Frozen) -> QemuSandbox:
        """A sandbox for ``spec`` (the parent's Boxfile, its own uid slot, workspace and
        deadline) restored from ``frozen``: the parent's memory and processes, its
        ``/data`` copy-on-write, a fresh agent token, clock and RNG seed."""
        self.check(spec)
        if len(spec.mounts) != len(frozen.mounts):
            raise SandboxError("fork: the parent's mounts differ from its Boxfile's")
        name = self._vm_name(spec.name)
        vm_dir = self._vm_dir(name)
        vm_dir.mkdir(mode=0o700)
        write_owner(vm_dir, spec)
        vm: Vm | None = None
        try:
            vm = fork_vm(frozen, name=name, vm_dir=vm_dir, uid=vmm_uid(self.settings,
                                                                       spec.isolation))  # fmt: skip
            start_fork(vm, frozen)
            sandbox = QemuSandbox(self, spec, vm, vm_dir, restored=True, forked=frozen.streams,
                                  ram_in_stream=frozen.ram_fd is None)  # fmt: skip
            sandbox._connect()
            return sandbox
        except BaseException:
            if vm is not None:
                log.warning("fork VM failed to start", sandbox=name, log=vm.log_tail(800))
                vm.kill()
            shutil.rmtree(vm_dir, ignore_errors=True)
            raise

    def _sandbox(self, spec: SandboxSpec, vm: Vm, vm_dir: Path) -> QemuSandbox:
        """A :class:`QemuSandbox`, restored from the snapshot unless cold."""
        return QemuSandbox(self, spec, vm, vm_dir, restored=not self.cold)
