"""The firecracker backend: a user-installed Firecracker under its jailer, where KVM works.

No registry we reach ships a Firecracker binary, so this backend uses the one
the user configured (``Settings.firecracker_binary``, with ``jailer`` next to
it) and refuses, naming the fix, where there is none, where it is older than
:data:`~agentbox.backends.microvm._firecracker.MIN_VERSION` (the first release that
describes virtio-mmio devices to x86_64 guests via ACPI, which Debian's cloud
kernel needs), or where KVM cannot boot our guest
(:func:`agentbox.backends.microvm.probe_kvm`; on a PVM host it cannot).

It is the qemu backend with another VMM: the same PVH vmlinux, root and
``/data`` disks, guest agent, :class:`~agentbox.backends.microvm._channel.Channel`,
:class:`~agentbox.backends.microvm._guest.GuestSession` (kernel + nonce check before
every command, gateway streams multiplexed on the channel), safe export of
results, posture read off the running VMM, crash recovery of orphan VMs. So
:class:`FirecrackerBackend` and :class:`~agentbox.backends.microvm.qemu.QemuBackend` both
extend :class:`~agentbox.backends.microvm._base._MicrovmBackend` (neither extends the
other), and :class:`FirecrackerSandbox` extends
:class:`~agentbox.backends.microvm.qemu.QemuSandbox`, which never asks which VMM runs
its VM; what differs is
:class:`FirecrackerVm`: the jailer instead of bwrap + setpriv, a config file
instead of a command line, and the channel, which is virtio-vsock (the agent
listens on guest port :data:`~agentbox.guest.agent.VSOCK_PORT`; the host
reaches it through Firecracker's hybrid-vsock unix socket) because Firecracker
has no virtio-serial. Every sandbox cold-boots (no snapshots: on real KVM a
Firecracker cold boot takes ~0.15 s). See docs/reference/firecracker-backend.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Literal

import psutil

from agentbox.backends.base import Posture, SandboxSpec
from agentbox.backends.microvm import (
    VSOCK_UDS,
    Cgroup,
    FcSpec,
    Vm,
    VmConfig,
    cgroup_dirs,
    check_versions,
    chroot_dir,
    connect_vsock,
    ensure_initramfs,
    ensure_vsock_modules,
    jail_entries,
    jailer_argv,
    make_mount_disk,
    place_files,
    spawn,
    version_output,
)
from agentbox.backends.microvm._base import _MicrovmBackend
from agentbox.backends.microvm._recover import vmm_uid
from agentbox.backends.microvm.kvm import probe_kvm
from agentbox.backends.microvm.qemu import QemuSandbox
from agentbox.backends.registry import DoctorRow
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError, UnsupportedError
from agentbox.guest.agent import VSOCK_PORT

log = get_logger(__name__)


def firecracker_binaries(settings: Settings) -> tuple[Path, Path]:
    """The configured ``firecracker`` and its ``jailer``; UnsupportedError if missing."""
    fc = settings.firecracker_binary
    if fc is None:
        raise UnsupportedError(
            "no firecracker binary configured",
            fix="install Firecracker and set AGENTBOX_FIRECRACKER_BINARY=/path/to/firecracker",
        )
    fc = fc.absolute()  # the jailer wants absolute paths
    if not (fc.is_file() and os.access(fc, os.X_OK)):
        raise UnsupportedError(f"firecracker binary {fc} is not executable", fix="check the path")
    jailer = fc.with_name("jailer")
    if not (jailer.is_file() and os.access(jailer, os.X_OK)):
        raise UnsupportedError(f"no jailer next to {fc}", fix="install Firecracker's jailer too")
    if "firecracker" not in fc.name:
        # The jailer refuses an exec file whose name does not contain "firecracker".
        raise UnsupportedError(
            f"the jailer only runs a binary named *firecracker*, not {fc.name}",
            fix="rename or symlink it, e.g. …/firecracker",
        )
    return fc, jailer


def fc_uid(settings: Settings, isolation: Literal["standard", "strict"]) -> int:
    """The uid Firecracker runs as: the qemu backend's, but never 0.

    The jailer only drops capabilities by switching to a non-root uid, and it
    must itself run as root; so where ``standard`` would mean root the VMM
    gets the dedicated uid that ``strict`` uses.
    """
    uid = vmm_uid(settings, isolation)
    return uid if uid != 0 else vmm_uid(settings, "strict")


def facility(settings: Settings) -> _host.Facility:
    """The doctor's row: binary, jailer, version, KVM. Never raises."""
    try:
        fc, jailer = firecracker_binaries(settings)
        version = check_versions(version_output(fc), version_output(jailer))
    except UnsupportedError as exc:
        detail = str(exc).removesuffix(f" (fix: {exc.fix})") if exc.fix else str(exc)
        return _host.Facility("firecracker", False, detail, exc.fix or "")
    except Exception as exc:  # a probe must not take the whole report down
        return _host.Facility("firecracker", False, f"probe failed: {exc}", "")
    where = f"{fc} v{'.'.join(map(str, version))}"
    try:
        kvm = probe_kvm(settings)
    except Exception as exc:
        return _host.Facility("firecracker", False, f"{where}; KVM probe failed: {exc}", "")
    if not kvm.ok:
        return _host.Facility("firecracker", False, f"{where}; needs KVM: {_kvm_why(kvm)}", kvm.fix)
    return _host.Facility("firecracker", True, f"{where} with its jailer; KVM boots the guest")


def doctor_rows(settings: Settings) -> list[DoctorRow]:
    """One row: :func:`facility`, "refused" rather than "missing" once a binary is set."""
    return [DoctorRow(facility(settings), present=settings.firecracker_binary is not None)]


def _kvm_why(kvm: _host.Facility) -> str:
    # The probe is the qemu backend's; its "falls back to TCG" does not apply here.
    return kvm.detail.removesuffix("; using TCG")


def _vm_id(name: str) -> str:
    """A jailer id (letters, digits, hyphens; at most 64) unique per VM."""
    base = re.sub(r"[^A-Za-z0-9-]", "-", name)[:57] or "vm"
    return f"{base}-{secrets.token_hex(3)}"


class FirecrackerVm(Vm):
    """One Firecracker process under its jailer; ``kill`` is idempotent (see :class:`Vm`)."""

    def __init__(self, cfg: VmConfig, *, firecracker: Path, jailer: Path, vm_dir: Path) -> None:
        super().__init__(cfg)
        self.firecracker = firecracker
        self.jailer = jailer
        self.jail_base = vm_dir / "jail"

    @property
    def chroot(self) -> Path:
        """The VMM's root directory (made by us, entered by the jailer)."""
        return chroot_dir(self.jail_base, self.firecracker, self.cfg.name)

    @property
    def vsock_socket(self) -> Path:
        """Firecracker's hybrid-vsock unix socket, seen from the host."""
        return self.chroot / VSOCK_UDS.lstrip("/")

    def fc_spec(self) -> FcSpec:
        """The VM as :mod:`agentbox.backends.microvm._firecracker` takes it."""
        c = self.cfg
        return FcSpec(
            id=c.name, kernel=c.kernel.vmlinux, initramfs=c.initramfs, root_disk=c.root_disk,
            data_disk=c.data_disk, vcpus=c.cpus, memory_mib=c.memory_mib, uid=c.uid, gid=c.gid,
            cmdline_extra=c.cmdline_extra, mount_disks=c.mount_disks,
        )  # fmt: skip

    def argv(self) -> list[str]:
        """The whole command line (``unshare`` → jailer → Firecracker)."""
        return jailer_argv(
            self.jailer, self.firecracker, self.fc_spec(), chroot_base=self.jail_base
        )

    def start(self, *, stdout_fd: int | None = None) -> None:
        """Fill the jail and start the jailer; Firecracker boots from its config file."""
        c = self.cfg
        c.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        spec = self.fc_spec()
        place_files(self.chroot, spec)
        # The jailer makes the cgroups (the same dirs the qemu backend uses), so they
        # are recorded here for terminate() to empty and remove; they may not exist yet.
        cg = Cgroup.__new__(Cgroup)
        cg.name, cg.dirs = c.name, cgroup_dirs(c.name)
        self.cgroup = cg
        with self.log_path.open("ab") as logf:
            # Guest serial output (console=ttyS0) lands on Firecracker's stdout: the log.
            self.proc = spawn(
                self.argv(),
                cgroup=None,
                stdout_fd=stdout_fd if stdout_fd is not None else logf.fileno(),
                stderr_fd=logf.fileno(),
            )

    def log_tail(self, n: int = 2000) -> str:
        """The end of the jailer's output and Firecracker's own log."""
        own = ""
        with contextlib.suppress(OSError):
            own = (self.chroot / "firecracker.log").read_bytes()[-n:].decode(errors="replace")
        return (super().log_tail(n) + own)[-n:]

    def connect(self, timeout: float) -> socket.socket:
        """Connect to the guest agent through hybrid vsock once it listens."""
        try:
            return connect_vsock(
                self.vsock_socket, VSOCK_PORT, timeout=timeout, name=self.cfg.name, alive=self.alive
            )
        except SandboxError as exc:
            raise type(exc)(f"{exc}; VMM log: {self.log_tail(800)}") from exc

    def vmm_pid(self, timeout: float = 5.0) -> int:
        """Firecracker's host pid (the jailer execs it in place, below ``unshare``)."""
        if self.proc is None:
            raise SandboxError("VM not started", sandbox=self.cfg.name)
        want = self.firecracker.name
        end = time.monotonic() + timeout
        while True:
            try:
                for pr in psutil.Process(self.proc.pid).children(recursive=True):
                    name = pr.name()
                    if name and (want.startswith(name) or name.startswith(want[:15])):
                        return pr.pid
            except psutil.Error:
                pass
            if time.monotonic() > end or not self.alive():
                raise SandboxError("no Firecracker process found", sandbox=self.cfg.name)
            time.sleep(0.02)

    def qmp(self, *commands: tuple[str, dict[str, Any] | None], timeout: float = 30.0) -> list[Any]:
        """Firecracker has no QMP."""
        raise UnsupportedError("Firecracker has no QMP", fix="use the qemu backend")


class FirecrackerBackend(_MicrovmBackend):
    """Makes Firecracker microVM sandboxes (``name = "firecracker"``); always cold boots."""

    name = "firecracker"
    snapshots = False  # every Firecracker sandbox boots cold
    environments_refused: str | None = (
        "its guest takes read-only disks only (no copy-on-write layer, no extra socket "
        "relayed yet), and this kind of host (PVM, no nested KVM) cannot boot it to test one"
    )

    def __init__(
        self,
        settings: Settings,
        *,
        cold: bool = True,
        rootfs: tuple[Path, str] | None = None,
    ) -> None:
        """``rootfs`` (a root directory and its content hash) overrides the image lookup.

        ``cold`` is accepted for the CLI's sake; every Firecracker sandbox boots cold.
        """
        del cold
        super().__init__(settings, cold=True, rootfs=rootfs)

    def accel(self) -> str:
        """``kvm``: Firecracker has no emulation to fall back to."""
        return "kvm"

    def check(self, spec: SandboxSpec) -> None:
        """Refuse, naming the fix, unless Firecracker (recent enough), its jailer and a
        KVM that boots our guest are here, and the spec is one a microVM can honour."""
        fc, jailer = firecracker_binaries(self.settings)
        check_versions(version_output(fc), version_output(jailer))
        kvm = probe_kvm(self.settings)
        if not kvm.ok:
            raise UnsupportedError(f"Firecracker needs KVM: {_kvm_why(kvm)}", fix=kvm.fix)
        if os.geteuid() != 0:
            raise UnsupportedError("the jailer must run as root", fix="run agentbox's launcher")
        for tool in ("unshare", "mkfs.ext4", "busybox"):
            if shutil.which(tool) is None:
                raise UnsupportedError(f"{tool} not found", fix="scripts/setup.sh")
        if spec.mounts:
            self._check_mounts(spec)  # read-only disks, as in the qemu backend
        if spec.workspace is not None and not spec.workspace.is_dir():
            raise SandboxError(f"workspace {spec.workspace} is not a directory", sandbox=spec.name)

    def base_config(self, spec: SandboxSpec, run_dir: Path, data_disk: Path | None) -> VmConfig:
        """The shared microVM shape, with the vsock initramfs, KVM and the jail uid."""
        cfg = super().base_config(spec, run_dir, data_disk)
        vsock = ensure_vsock_modules(self.settings, cfg.kernel)
        initramfs = ensure_initramfs(self.settings, cfg.kernel, extra_modules=vsock)
        uid = fc_uid(self.settings, spec.isolation)
        return dataclasses.replace(cfg, initramfs=initramfs, accel="kvm", uid=uid, gid=uid)

    def _vm_name(self, sandbox: str) -> str:
        """A jailer id (see :func:`_vm_id`)."""
        return _vm_id(sandbox)

    def _mount_disks(self, spec: SandboxSpec, vm_dir: Path) -> tuple[Path, ...]:
        """One ext4 image per declared mount, made in ``vm_dir`` (placed in the jail)."""
        return tuple(
            make_mount_disk(m.source, vm_dir / f"m{i}.img", index=i, uid=spec.uid)
            for i, m in enumerate(spec.mounts)
        )

    def _vm(self, cfg: VmConfig, vm_dir: Path) -> FirecrackerVm:
        """Firecracker under its jailer, its chroot in ``vm_dir``, not started yet."""
        fc, jailer = firecracker_binaries(self.settings)
        return FirecrackerVm(cfg, firecracker=fc, jailer=jailer, vm_dir=vm_dir)

    def _start(self, vm: Vm) -> None:
        """Fill the jail and start the jailer (a cold boot: Firecracker keeps no snapshot)."""
        vm.start()

    def _sandbox(self, spec: SandboxSpec, vm: Vm, vm_dir: Path) -> FirecrackerSandbox:
        """A :class:`FirecrackerSandbox` (never restored)."""
        return FirecrackerSandbox(self, spec, vm, vm_dir, restored=False)


class FirecrackerSandbox(QemuSandbox):
    """A live Firecracker sandbox; everything but posture's label is the qemu sandbox's."""

    vm: FirecrackerVm

    def posture(self) -> Posture:
        """Host-side facts read off the live Firecracker process, and inside facts."""
        p = super().posture()
        return Posture(p.backend, "kvm", p.checks)

    def jail_contents(self) -> dict[str, str]:
        """What the VMM's root holds now (name → kind), for diagnostics and tests."""
        return dict(jail_entries(self.vm.chroot))
