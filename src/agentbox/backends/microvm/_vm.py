"""One QEMU microVM process in its jail: start, connect the agent channel, QMP, kill.

The command line is the same for a cold boot and a snapshot restore (paths
inside the jail are fixed under ``/vm``), which is what lets a restore swap in
a fresh ``/data`` disk: only the host file bound at ``/vm/data.img`` differs.
Declared read-only mounts are disks too, bound at ``/vm/m<i>.img`` and
attached ``readonly=on`` (the guest sees a read-only block device: not even
its root can write to it or mount it read-write).

Guest RAM is anonymous memory on a cold boot. A snapshot template maps it from a
file (``ram_file``, shared, so the file holds the RAM when it is saved) and a
restored VM maps that RAM private from a sealed memfd (``ram_fd``): its reads
share the page cache with every VM restored from the same snapshot, its writes
are copied into its own pages. Both migrate with ``x-ignore-shared`` (set over
QMP), so the saved state carries the devices but not the RAM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends.microvm._jail import VMM_PIDS_MAX, Cgroup, JailSpec, jail_argv, spawn
from agentbox.backends.microvm._kernel import Kernel
from agentbox.backends.microvm._sockpath import connectable
from agentbox.core.log import get_logger
from agentbox.errors import GuestError, SandboxError

log = get_logger(__name__)

#: QEMU's seccomp filter with every optional deny turned on.
SANDBOX_FLAGS = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: The CPU model under TCG: ``max`` has the AVX/AVX2 that QEMU 7.2's TCG emulates and
#: that Claude Code's native binary requires (under ``qemu64`` it dies with SIGILL).
TCG_CPU = "max"
#: TCG translation cache, MiB (QEMU's default is up to 1 GiB per VM).
TCG_TB_MIB = 128
#: Host memory the VMM may use beyond guest RAM (QEMU itself, TCG cache, I/O buffers).
VMM_OVERHEAD = (TCG_TB_MIB + 384) * 1024**2


def host_tsc_khz() -> int:
    """The host's TSC frequency in kHz, for ``tsc_early_khz`` (no calibration hang)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


@dataclass
class VmConfig:
    """Everything that makes one VM's command line and jail."""

    name: str
    kernel: Kernel
    initramfs: Path
    root_disk: Path
    data_disk: Path | None
    run_dir: Path
    #: A fork's ``data_disk`` is a qcow2 overlay over this raw disk (bound read-only at
    #: ``/vm/data-base.img``, the overlay's backing file).
    data_base: Path | None = None
    #: One read-only disk per declared mount, in the order of the spec's mounts.
    mount_disks: tuple[Path, ...] = ()
    memory_mib: int = 512
    cpus: int = 1
    accel: str = "tcg"
    uid: int = 0
    gid: int = 0
    qemu_binary: str = "qemu-system-x86_64"
    marker: bool = False
    incoming_fd: int | None = None
    #: A template's RAM: this host file, bound at ``/vm/ram`` and mapped shared.
    ram_file: Path | None = None
    #: A restored VM's RAM: this sealed memfd (passed in), mapped private (copy-on-write).
    ram_fd: int | None = None
    #: A fork of a VM whose RAM was one of those: the same memory backend id (``ram``, so
    #: the migration stream's RAM block is found), anonymous memory.
    ram_anon: bool = False
    cmdline_extra: tuple[str, ...] = ()
    use_cgroup: bool = True
    jail: bool = True
    extra_args: tuple[str, ...] = field(default=())


def qemu_argv(cfg: VmConfig, *, in_jail: bool = True) -> list[str]:
    """QEMU's argv; paths are the jail's (``/vm/…``) unless ``in_jail`` is False."""

    def p(host: Path, jail: str) -> str:
        return jail if in_jail else str(host)

    append = [
        "console=ttyS0", "quiet", "loglevel=1", "panic=-1", "reboot=t",
        f"tsc_early_khz={host_tsc_khz()}", "tsc=reliable", "random.trust_cpu=on",
        "init=/init", *cfg.cmdline_extra,
    ]  # fmt: skip
    if cfg.marker:
        append.append("agentbox_marker=1")
    cpu = "host" if cfg.accel == "kvm" else TCG_CPU
    accel = "kvm" if cfg.accel == "kvm" else f"tcg,tb-size={TCG_TB_MIB}"
    machine = "microvm,isa-serial=on,rtc=on,pic=off,pit=on"
    ram: list[str] = []
    if cfg.ram_anon:
        machine += ",memory-backend=ram"
        ram = ["-object", f"memory-backend-ram,id=ram,size={cfg.memory_mib}M"]
    elif cfg.ram_fd is not None or cfg.ram_file is not None:
        if cfg.ram_fd is not None:  # private: the guest's writes never reach the memfd
            where, share = f"/proc/self/fd/{cfg.ram_fd}", "off"
        else:
            assert cfg.ram_file is not None
            where, share = p(cfg.ram_file, "/vm/ram"), "on"
        machine += ",memory-backend=ram"
        ram = [
            "-object", f"memory-backend-file,id=ram,size={cfg.memory_mib}M,mem-path={where},"
                       f"share={share}",
        ]  # fmt: skip
    argv = [
        cfg.qemu_binary,
        "-M", machine, *ram,
        "-accel", accel, "-cpu", cpu,
        "-m", f"{cfg.memory_mib}M", "-smp", str(cfg.cpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", p(cfg.kernel.vmlinux, "/vm/vmlinux"),
        "-initrd", p(cfg.initramfs, "/vm/initramfs"),
        "-append", " ".join(append),
        "-drive", f"id=root,file={p(cfg.root_disk, '/vm/root.img')},format=raw,if=none,"
                  "readonly=on,cache=unsafe",
        "-device", "virtio-blk-device,drive=root",
    ]  # fmt: skip
    if cfg.data_disk is not None:
        fmt = "raw" if cfg.data_base is None else "qcow2"
        argv += [
            "-drive", f"id=data,file={p(cfg.data_disk, '/vm/data.img')},format={fmt},if=none,"
                      "cache=writeback,discard=unmap",
            "-device", "virtio-blk-device,drive=data",
        ]  # fmt: skip
    for i, disk in enumerate(cfg.mount_disks):
        argv += [
            "-drive", f"id=m{i},file={p(disk, f'/vm/m{i}.img')},format=raw,if=none,"
                      "readonly=on,cache=unsafe",
            "-device", f"virtio-blk-device,drive=m{i}",
        ]  # fmt: skip
    run = p(cfg.run_dir, "/vm/run")
    argv += [
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=agent,path={run}/agent.sock,server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=agentbox.0",
        "-qmp", f"unix:{run}/qmp.sock,server=on,wait=off",
        "-sandbox", SANDBOX_FLAGS,
    ]  # fmt: skip
    argv += ["-serial", "stdio"] if cfg.marker else ["-serial", "none"]
    if cfg.incoming_fd is not None:
        # deferred: x-ignore-shared (QEMU 7.2 has no -global for it) is set first over QMP
        mapped = cfg.ram_fd is not None or cfg.ram_file is not None
        argv += ["-S", "-incoming", "defer" if mapped else f"fd:{cfg.incoming_fd}"]
    return argv + list(cfg.extra_args)


class Vm:
    """A running (or dead) VMM process; ``kill`` is idempotent and checks nothing survived."""

    def __init__(self, cfg: VmConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.cgroup: Cgroup | None = None
        self._killed = False

    @property
    def agent_socket(self) -> Path:
        return self.cfg.run_dir / "agent.sock"

    @property
    def qmp_socket(self) -> Path:
        return self.cfg.run_dir / "qmp.sock"

    @property
    def log_path(self) -> Path:
        return self.cfg.run_dir.parent / f"{self.cfg.run_dir.name}.log"

    def jail_spec(self) -> JailSpec:
        c = self.cfg
        ro = [(c.kernel.vmlinux, "/vm/vmlinux"), (c.initramfs, "/vm/initramfs"),
              (c.root_disk, "/vm/root.img")]  # fmt: skip
        ro += [(disk, f"/vm/m{i}.img") for i, disk in enumerate(c.mount_disks)]
        if c.data_base is not None:
            ro.append((c.data_base, "/vm/data-base.img"))
        rw = [(c.run_dir, "/vm/run")]
        if c.ram_file is not None:
            rw.append((c.ram_file, "/vm/ram"))
        if c.data_disk is not None:
            rw.append((c.data_disk, "/vm/data.img"))
        devs = ("/dev/kvm",) if c.accel == "kvm" else ()
        return JailSpec(tuple(ro), tuple(rw), c.uid, c.gid, devs)

    def start(self, *, stdout_fd: int | None = None) -> None:
        """Start the VMM in its jail and cgroup."""
        c = self.cfg
        c.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(c.run_dir, c.uid, c.gid)
        c.run_dir.chmod(0o700)
        if c.data_disk is not None:
            os.chown(c.data_disk, c.uid, c.gid)
            c.data_disk.chmod(0o600)
        for disk in c.mount_disks:  # the VMM's uid (strict: not ours) must read them
            if disk.parent != c.run_dir.parent:
                # A shared cached disk (a frozen environment's, see cached_mount_disk):
                # root's and world-readable like the root disk; never written.
                disk.chmod(0o444)
                continue
            os.chown(disk, c.uid, c.gid)
            disk.chmod(0o400)
        argv = qemu_argv(c, in_jail=c.jail)
        if c.jail:
            argv = jail_argv(self.jail_spec(), argv)
        if c.use_cgroup:
            mem = c.memory_mib * 1024**2 + VMM_OVERHEAD
            self.cgroup = Cgroup(c.name, pids_max=VMM_PIDS_MAX, memory_bytes=mem)
        fds = tuple(fd for fd in (c.incoming_fd, c.ram_fd) if fd is not None)
        with self.log_path.open("ab") as logf:
            self.proc = spawn(
                argv,
                cgroup=self.cgroup,
                pass_fds=fds,
                stdout_fd=stdout_fd if stdout_fd is not None else logf.fileno(),
                stderr_fd=logf.fileno(),
            )

    def log_tail(self, n: int = 2000) -> str:
        """The end of QEMU's own stderr (never guest output)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def vmm_pid(self, timeout: float = 5.0) -> int:
        """The QEMU process's host pid (inside bwrap's pid namespace it is not 1)."""
        if self.proc is None:
            raise SandboxError("VM not started", sandbox=self.cfg.name)
        end = time.monotonic() + timeout
        while True:
            with contextlib.suppress(psutil.Error):
                procs = [psutil.Process(self.proc.pid)]
                procs += procs[0].children(recursive=True)
                for pr in procs:
                    if pr.name().startswith("qemu-system"):
                        return pr.pid
            if time.monotonic() > end or not self.alive():
                raise SandboxError("no QEMU process found", sandbox=self.cfg.name)
            time.sleep(0.02)

    def connect(self, timeout: float) -> socket.socket:
        """Connect to the agent's virtio-serial socket once QEMU listens on it."""
        end = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with connectable(self.agent_socket) as where:
                    s.connect(where)
                return s
            except OSError:
                s.close()
            if not self.alive():
                raise SandboxError(f"QEMU exited: {self.log_tail()}", sandbox=self.cfg.name)
            if time.monotonic() > end:
                raise GuestError("QEMU's agent socket never appeared", sandbox=self.cfg.name)
            time.sleep(0.005)

    def qmp(self, *commands: tuple[str, dict[str, Any] | None], timeout: float = 30.0) -> list[Any]:
        """Run QMP commands in order on a fresh connection; return their results."""
        from agentbox.backends.microvm._qmp import run_qmp

        return run_qmp(self.qmp_socket, list(commands), timeout=timeout, name=self.cfg.name)

    def terminate(self) -> None:
        """Kill the VMM and its jail and remove its cgroup; keeps the run dir. Idempotent."""
        if self._killed:
            return
        self._killed = True
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.cgroup is not None:
            self.cgroup.remove()

    def kill(self) -> None:
        """:meth:`terminate`, then remove the socket dir and QEMU's log; idempotent."""
        self.terminate()
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.log_path.unlink()
