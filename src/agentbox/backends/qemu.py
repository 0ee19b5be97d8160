"""The qemu backend: every sandbox a QEMU microVM with its own kernel and a confined VMM.

``QemuBackend(settings)`` boots sandboxes by restoring a snapshot of a guest
that booted once to a ready agent (made on first use, per image and VM
shape); ``QemuBackend(settings, cold=True)`` boots each one fresh. See
docs/reference/qemu-backend.md and docs/explanation/microvm-isolation.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import secrets
import shutil
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Literal

from agentbox import _host, _proc
from agentbox._log import get_logger
from agentbox.backends._attached import AttachedOnly
from agentbox.backends._microvm_posture import read_posture
from agentbox.backends.base import (
    GATEWAY_SOCKET_NAME,
    HOME_IN_SANDBOX,
    LABEL,
    WORKSPACE_IN_SANDBOX,
    BackendKind,
    BaseSandbox,
    ExecResult,
    OutputCallback,
    Posture,
    SandboxSpec,
)
from agentbox.config import Settings
from agentbox.errors import AgentboxError, GuestError, ImageError, SandboxError, UnsupportedError
from agentbox.microvm._channel import Channel
from agentbox.microvm._diskexport import export_disk
from agentbox.microvm._disks import (
    MAX_MOUNTS,
    cached_mount_disk,
    ensure_root_disk,
    make_data_disk,
    make_mount_disk,
    mount_label,
)
from agentbox.microvm._export import write_tar
from agentbox.microvm._guest import GuestSession, host_kernel
from agentbox.microvm._initramfs import ensure_initramfs
from agentbox.microvm._kernel import OVERLAY_MODULES, ensure_kernel, ensure_modules
from agentbox.microvm._snapshot import ensure_snapshot, wait_incoming
from agentbox.microvm._vm import Vm, VmConfig
from agentbox.microvm.kvm import probe_kvm
from agentbox.paths import check_inside

__all__ = ["QemuBackend", "QemuSandbox", "kill_sandbox", "probe_kvm", "recover_sandbox", "vmm_uid"]

log = get_logger("backends.qemu")

BOOT_TIMEOUT = 180.0
#: Guest tmpfs mounts under which a mount target may be made at start.
_GUEST_TMPFS = (PurePosixPath("/tmp"), PurePosixPath(HOME_IN_SANDBOX), PurePosixPath("/run"))
#: Extra host sockets of a gateway dir the guest serves (the egress proxy's), at most.
_MAX_SOCKETS = 4
#: Where /init binds the guest agent; a mount must neither hide it nor land in it.
_AGENT_DIR = PurePosixPath("/opt/agentbox")
_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": HOME_IN_SANDBOX,
    "LANG": "C.UTF-8",
    "USER": "agent",
}


def vmm_uid(settings: Settings, isolation: Literal["standard", "strict"]) -> int:
    """The host uid the VMM runs as: yours (standard) or one that owns nothing (strict).

    The strict uid lies just past the 65536 ids podman maps from ``subid_base``,
    so it is neither the user nor any container's uid.
    """
    if isolation == "strict":
        return settings.subid_base + 65536 + 1
    return os.getuid()


@functools.cache
def _qemu_version(binary: str) -> str:
    try:
        return _proc.run([binary, "--version"], timeout=30).stdout.split("\n")[0]
    except AgentboxError:
        return "unknown"


class QemuBackend(AttachedOnly):  # detached sandboxes: not built here yet
    """Makes QEMU microVM sandboxes (``name = "qemu"``)."""

    name = "qemu"
    kind: BackendKind = "microvm"
    runtimes: tuple[str, ...] = ()
    snapshots = True

    def shares_host_kernel(self, runtime: str) -> bool:
        """Never: the guest runs its own kernel whatever ``runtime`` says."""
        del runtime
        return False

    def bind_source_uid(self, runtime: str) -> int | None:
        """None: mounts reach the guest as disks the launcher (root) builds."""
        del runtime
        return None

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
        self.settings = settings
        self.cold = cold
        self._accel = accel
        self._rootfs = rootfs

    # -- preparation
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
        if spec.workspace is not None and not spec.workspace.is_dir():
            raise SandboxError(f"workspace {spec.workspace} is not a directory", sandbox=spec.name)
        if spec.mounts:
            self._check_mounts(spec)

    def _check_mounts(self, spec: SandboxSpec) -> None:
        """Each mount: a host directory at a target the guest can mount on (a directory
        in the image's read-only root, or under a tmpfs). A read-only mount is shown
        read-only; a writable one (a frozen environment's directory, which may lie in
        the workspace) copy-on-write: its disk read-only under an overlay in the guest
        whose writes are capped by the disk limit and dropped with the VM."""
        if len(spec.mounts) > MAX_MOUNTS:
            raise UnsupportedError(
                f"{len(spec.mounts)} declared mounts; a microVM takes at most {MAX_MOUNTS}",
                fix="merge the mounted directories under fewer roots",
            )
        for m in spec.mounts:
            if not m.source.is_dir():
                raise SandboxError(f"mount source {m.source} is not a directory", sandbox=spec.name)
        targets = [PurePosixPath(m.target) for m in spec.mounts]
        for i, t in enumerate(targets):
            for j, other in enumerate(targets):
                if i != j and (t == other or other in t.parents):
                    raise UnsupportedError(
                        f"mount target {t} is {'the same as' if t == other else 'inside'} "
                        f"mount target {other}",
                        fix="declare targets that do not nest in one another",
                    )
            if t == _AGENT_DIR or _AGENT_DIR in t.parents or t in _AGENT_DIR.parents:
                raise UnsupportedError(
                    f"mount target {t} would shadow or sit inside the guest agent ({_AGENT_DIR})",
                    fix="mount it somewhere else, e.g. under /opt/<name> or /home/agent",
                )
            in_workspace = PurePosixPath(WORKSPACE_IN_SANDBOX) in t.parents
            if in_workspace and not spec.mounts[i].read_only:
                continue  # copy-on-write: the guest makes its mount point on /data
            if in_workspace:
                raise UnsupportedError(
                    f"mount target {t} lies in the workspace, a disk of its own in a microVM",
                    fix="mount it outside /workspace, e.g. under /home/agent",
                )
            if any(base in t.parents for base in _GUEST_TMPFS):
                continue  # the guest agent makes it on the tmpfs before mounting
            self._check_target_in_image(spec, self._root(spec)[0], t)

    def _check_target_in_image(
        self, spec: SandboxSpec, rootfs: Path, target: PurePosixPath
    ) -> None:
        # lstat each component: a symlink in the image would lead the guest's mount
        # elsewhere (or out of the root, on this host's side of the check).
        path = rootfs
        for part in target.parts[1:]:
            path = path / part
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                mode = None
            if mode is None or not stat.S_ISDIR(mode):
                what = "is missing" if mode is None else "is not a plain directory"
                raise UnsupportedError(
                    f"mount target {target}: /{path.relative_to(rootfs)} {what} in image "
                    f"{spec.image}, whose root is read-only in a microVM",
                    fix=f"use a target under {' or '.join(map(str, _GUEST_TMPFS))} (made at "
                    f"start), or an image that has the directory {target}",
                )

    def _root(self, spec: SandboxSpec) -> tuple[Path, str]:
        if self._rootfs is not None:
            return self._rootfs
        from agentbox import image

        info = image.resolve(self.settings, spec.image)
        if info.rootfs is None or info.hash is None:
            raise ImageError(
                f"image {info.name} has no kept root directory for microVMs "
                "(run `agentbox image build`)"
            )
        return info.rootfs, info.hash

    def base_config(self, spec: SandboxSpec, run_dir: Path, data_disk: Path | None) -> VmConfig:
        """The VM config for ``spec`` (shared by cold boots, templates and restores)."""
        kernel = ensure_kernel(self.settings)
        # overlay: copy-on-write mounts (frozen environments) in every guest, so one
        # snapshot template serves tasks with and without them.
        overlay = ensure_modules(self.settings, kernel, OVERLAY_MODULES)
        initramfs = ensure_initramfs(self.settings, kernel, extra_modules=overlay)
        rootfs, key = self._root(spec)
        root_disk = ensure_root_disk(self.settings, rootfs, key)
        uid = vmm_uid(self.settings, spec.isolation)
        cpus = max(1, min(math.ceil(spec.resources.cpus), os.cpu_count() or 1))
        return VmConfig(
            name=spec.name,
            kernel=kernel,
            initramfs=initramfs,
            root_disk=root_disk,
            data_disk=data_disk,
            run_dir=run_dir,
            memory_mib=max(128, spec.resources.memory // 1024**2),
            cpus=cpus,
            accel=self.accel(),
            uid=uid,
            gid=uid,
            qemu_binary=self.settings.qemu_binary,
            # Cold: /init mounts /data before the agent starts. Snapshots: the
            # template preloads what a session may import, and never mounts /data.
            cmdline_extra=("agentbox_data=1",) if self.cold else ("agentbox_preload=1",),
        )

    def _vm_dir(self, name: str) -> Path:
        d = self.settings.data_dir / "microvm"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d / name

    # -- Protocol
    def create(self, spec: SandboxSpec) -> QemuSandbox:
        """Boot (or restore) a VM for ``spec`` and greet its agent; it idles until exec."""
        self.check(spec)
        name = f"{spec.name}-{secrets.token_hex(3)}"
        vm_dir = self._vm_dir(name)
        vm_dir.mkdir(mode=0o700)
        # Who made it, and for which workspace: a launcher that restarts after a crash
        # saves the orphan's /data there (recover_sandbox) before removing the VM.
        owner = {
            "pid": os.getpid(),
            LABEL: spec.name,
            "workspace": spec.workspace and str(spec.workspace),
        }
        (vm_dir / "owner").write_text(json.dumps(owner))
        vm: Vm | None = None
        try:
            limit = spec.resources.disk_limit(self.settings)  # /data's ext4: the disk limit
            data = make_data_disk(
                spec.workspace, vm_dir / "data.img", uid=spec.uid,
                size=limit.size, inodes=limit.inodes,
            )  # fmt: skip
            mounts = tuple(
                make_mount_disk(m.source, vm_dir / f"m{i}.img", index=i, uid=spec.uid)
                if m.read_only
                # Copy-on-write sources never change (frozen environments): cached.
                else cached_mount_disk(self.settings, m.source, index=i, uid=spec.uid)
                for i, m in enumerate(spec.mounts)
            )
            cfg = dataclasses.replace(
                self.base_config(spec, vm_dir / "run", data), name=name, mount_disks=mounts
            )
            fd: int | None = None
            if not self.cold:
                state = ensure_snapshot(
                    self.settings.cache_dir, cfg, _qemu_version(cfg.qemu_binary)
                )
                fd = os.open(state, os.O_RDONLY)
                cfg.incoming_fd = fd
            vm = Vm(cfg)
            try:
                vm.start()
            finally:
                if fd is not None:
                    os.close(fd)
            sandbox = QemuSandbox(self, spec, vm, vm_dir, restored=not self.cold)
            sandbox._connect()
            return sandbox
        except BaseException:
            if vm is not None:
                vm.kill()
            shutil.rmtree(vm_dir, ignore_errors=True)
            raise

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """One-shot: run ``argv``, write ``/workspace`` back to ``spec.workspace``, destroy."""
        with self.create(spec) as sb:
            left = max(1.0, sb.deadline_at - time.monotonic())
            try:
                res = sb.exec(
                    argv, timeout=left, stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr
                )
            except GuestError as exc:
                if sb.alive():
                    raise
                # Killed from outside (cancel, OOM, a crash): report it like a SIGKILL.
                res = ExecResult(137, stderr=f"agentbox: the VM died: {exc}\n".encode())
            if spec.workspace is not None:
                sb.sync_workspace()  # from the dead guest's disk if it was killed
            return res

    def kill(self, name: str) -> list[str]:
        """Kill now every VM created for sandbox ``name`` (its whole cgroup); idempotent.

        The owner's ``exec`` then returns exit 137 and its ``/data`` stays collectable.
        """
        return kill_sandbox(self.settings, name)

    def reap(self, name: str) -> list[str]:
        """Settle the VMs of sandbox ``name`` whose owner died (:func:`recover_sandbox`):
        kill the VMM, save ``/data`` into the recorded workspace, remove the VM dir."""
        return recover_sandbox(self.settings, name)

    def recover(self, name: str, into: Path) -> list[str]:
        """Save the ``/data`` disk of each dead VM of sandbox ``name`` into ``into`` (read in
        userspace in a jail, never mounted; ``into`` must lie inside the data dir)."""
        saved = []
        workspace = check_inside(self.settings.data_dir, into, what="recovery target")
        uid = vmm_uid(self.settings, "strict")
        for vm_dir, owner in _vm_dirs(self.settings):
            disk = vm_dir / "data.img"
            if owner.get(LABEL) != name or not disk.is_file():
                continue
            pid = owner.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
                raise SandboxError("its owner is alive: not recovering", sandbox=name)
            _replace_workspace(workspace, functools.partial(_export_into, disk, uid=uid))
            saved.append(vm_dir.name)
        return saved

    def owned(self) -> list[str]:
        """Sandboxes with a VM dir under this data dir (``microvm/*/owner`` names them)."""
        names = {str(owner.get(LABEL)) for _, owner in _vm_dirs(self.settings)}
        return sorted(n for n in names if n and n != "None")

    def cleanup_orphans(self) -> list[str]:
        """Settle VM dirs whose owning process is gone: kill the VMM, save ``/data``
        into the task workspace it was made from (see :func:`recover_sandbox`), remove."""
        return _settle(self.settings, None)


def recover_sandbox(settings: Settings, name: str) -> list[str]:
    """Settle the VMs of sandbox ``name`` whose owner died (a launcher crash).

    Each VM's VMM is killed, its ``/data`` disk read in userspace (in a jail, never
    mounted) into the workspace recorded at creation when that lies inside the data
    dir, so nothing the agent wrote is lost; then the VM dir is removed. Returns
    the VM names.
    """
    return _settle(settings, name)


def _settle(settings: Settings, name: str | None) -> list[str]:
    settled = []
    for vm_dir, owner in _vm_dirs(settings):
        if _orphaned(owner, name):
            _recover(settings, vm_dir, owner)
            settled.append(vm_dir.name)
    return settled


def _vm_dirs(settings: Settings) -> Iterator[tuple[Path, dict[str, object]]]:
    base = settings.data_dir / "microvm"
    if not base.is_dir():
        return
    for d in sorted(base.iterdir()):
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict):
            yield d, owner


def _orphaned(owner: dict[str, object], name: str | None) -> bool:
    if name is not None and owner.get(LABEL) != name:
        return False
    pid = owner.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid)


def _recover(settings: Settings, vm_dir: Path, owner: dict[str, object]) -> None:
    from agentbox.microvm._jail import Cgroup

    with contextlib.suppress(AgentboxError):
        cg = Cgroup.__new__(Cgroup)
        cg.name, cg.dirs = vm_dir.name, _cgroup_dirs(vm_dir.name)
        cg.remove()  # kills what is left in it first
    ws = owner.get("workspace")
    disk = vm_dir / "data.img"
    if isinstance(ws, str) and disk.is_file():
        try:
            workspace = check_inside(settings.data_dir, Path(ws), what="recorded workspace")
            uid = vmm_uid(settings, "strict")
            _replace_workspace(workspace, lambda dest: export_disk(disk, dest, uid=uid))
        except AgentboxError as exc:
            log.error("could not save an orphan VM's /data", vm=vm_dir.name, error=str(exc))
    shutil.rmtree(vm_dir, ignore_errors=True)


def _export_into(disk: Path, dest: Path, *, uid: int) -> None:
    export_disk(disk, dest, uid=uid)


def _replace_workspace(ws: Path, fill: Callable[[Path], object]) -> None:
    """Fill a staging dir next to ``ws`` with ``fill``, then swap its entries into ``ws``."""
    staging = ws.parent / f".{ws.name}.agentbox-export-{secrets.token_hex(4)}"
    try:
        fill(staging)
        for entry in list(ws.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in list(staging.iterdir()):
            entry.rename(ws / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def kill_sandbox(settings: Settings, name: str) -> list[str]:
    """Kill the VMMs of every VM created for sandbox ``name``; return the VM names."""
    base = settings.data_dir / "microvm"
    killed: list[str] = []
    if not base.is_dir():
        return killed
    for d in base.iterdir():
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or owner.get(LABEL) != name:
            continue
        for cg in _cgroup_dirs(d.name):
            with contextlib.suppress(OSError, ValueError):
                for pid in (cg / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)
        killed.append(d.name)
    return killed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited: its watchdog reaps its VMs before its parent reaps it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def _cgroup_dirs(name: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return [root / "agentbox" / name]
    return [root / "pids" / "agentbox" / name, root / "memory" / "agentbox" / name]


#: Seconds destroy() waits for a killed VMM's cgroups to become removable.
CGROUP_SETTLE = 30.0


class QemuSandbox(BaseSandbox):
    """A live microVM sandbox; ``destroy`` is idempotent and verifies nothing is left."""

    def __init__(
        self, backend: QemuBackend, spec: SandboxSpec, vm: Vm, vm_dir: Path, *, restored: bool
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.vm = vm
        self.vm_dir = vm_dir
        super().__init__(vm.cfg.name)
        self.restored = restored
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
            wait_incoming(self.vm, timeout=BOOT_TIMEOUT)
        sock = self.vm.connect(BOOT_TIMEOUT)
        chan = Channel(sock, name=self.name, on_broken=self._on_broken)
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
            _replace_workspace(
                ws,
                lambda dest: self._session().get_tar(
                    WORKSPACE_IN_SANDBOX, lambda tf: write_tar(tf, dest, links="any")
                ),
            )
        else:
            self.vm.terminate()
            uid = vmm_uid(self.backend.settings, "strict")
            _replace_workspace(
                ws, lambda dest: export_disk(self.vm_dir / "data.img", dest, uid=uid)
            )

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
