"""The base both microVM backends subclass: :class:`_MicrovmBackend`.

The qemu and firecracker backends differ in the VMM they start (QEMU under bwrap
and setpriv, restoring a snapshot; Firecracker under its jailer, cold) and in how
they reach the guest agent (virtio-serial, vsock). The rest is one: the traits,
which mounts a microVM can honour, the VM's shape (kernel, initramfs, root and
``/data`` disks, uid), its VM dir and owner record, the one-shot ``run``, and the
verbs for a sandbox whose owner died. That lives here, and each backend fills in
the hooks :meth:`~_MicrovmBackend.check`, :meth:`~_MicrovmBackend.accel`,
:meth:`~_MicrovmBackend._vm` and :meth:`~_MicrovmBackend._start`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import secrets
import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from agentbox.backends._attached import AttachedOnly, NoPool
from agentbox.backends.base import (
    HOME_IN_SANDBOX,
    LABEL,
    WORKSPACE_IN_SANDBOX,
    BackendKind,
    ExecResult,
    OutputCallback,
    SandboxSpec,
)
from agentbox.backends.microvm import (
    MAX_MOUNTS,
    OVERLAY_MODULES,
    Vm,
    VmConfig,
    cached_mount_disk,
    ensure_initramfs,
    ensure_kernel,
    ensure_modules,
    ensure_root_disk,
    make_data_disk,
    make_mount_disk,
)
from agentbox.backends.microvm._recover import (
    export_into,
    kill_sandbox,
    pid_alive,
    recover_sandbox,
    replace_workspace,
    settle,
    vm_dirs,
    vmm_uid,
    write_owner,
)
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import check_inside
from agentbox.errors import GuestError, ImageError, SandboxError, UnsupportedError

if TYPE_CHECKING:
    from agentbox.backends.microvm.qemu._sandbox import QemuSandbox

log = get_logger(__name__)

#: Guest tmpfs mounts under which a mount target may be made at start.
_GUEST_TMPFS = (PurePosixPath("/tmp"), PurePosixPath(HOME_IN_SANDBOX), PurePosixPath("/run"))
#: Where /init binds the guest agent; a mount must neither hide it nor land in it.
_AGENT_DIR = PurePosixPath("/opt/agentbox")


class _MicrovmBackend(AttachedOnly, NoPool):
    """Makes microVM sandboxes; a subclass names its VMM and starts it."""

    name: str
    kind: BackendKind = "microvm"
    runtimes: tuple[str, ...] = ()
    snapshots: bool

    def shares_host_kernel(self, runtime: str) -> bool:
        """Never: the guest runs its own kernel whatever ``runtime`` says."""
        del runtime
        return False

    def bind_source_uid(self, runtime: str) -> int | None:
        """None: mounts reach the guest as disks the launcher (root) builds."""
        del runtime
        return None

    def warm(self, image: str) -> None:
        """Nothing: a microVM's root disk is found when its sandbox is made."""
        del image

    def __init__(
        self, settings: Settings, *, cold: bool, rootfs: tuple[Path, str] | None = None
    ) -> None:
        """``cold`` boots every sandbox fresh; ``rootfs`` (a root directory and its
        content hash) overrides the image lookup."""
        self.settings = settings
        self.cold = cold
        self._rootfs = rootfs

    # -- hooks
    def check(self, spec: SandboxSpec) -> None:
        """Refuse, naming the fix, what this backend cannot honour, before anything starts."""
        raise NotImplementedError

    def accel(self) -> str:
        """The accelerator the VMM uses: ``kvm`` or ``tcg``."""
        raise NotImplementedError

    def _vm_name(self, sandbox: str) -> str:
        """A name unique per VM (its dir, its cgroup) for a VM of sandbox ``sandbox``."""
        return f"{sandbox}-{secrets.token_hex(3)}"

    def _mount_disks(self, spec: SandboxSpec, vm_dir: Path) -> tuple[Path, ...]:
        """One ext4 image per declared mount: made in ``vm_dir`` for a read-only mount;
        for a copy-on-write one, whose source never changes (a frozen environment),
        cached."""
        return tuple(
            make_mount_disk(m.source, vm_dir / f"m{i}.img", index=i, uid=spec.uid)
            if m.read_only
            else cached_mount_disk(self.settings, m.source, index=i, uid=spec.uid)
            for i, m in enumerate(spec.mounts)
        )

    def _vm(self, cfg: VmConfig, vm_dir: Path) -> Vm:
        """The VMM for ``cfg``, not started yet."""
        raise NotImplementedError

    def _start(self, vm: Vm) -> None:
        """Start ``vm``'s VMM (booting, or restoring a snapshot)."""
        raise NotImplementedError

    def _sandbox(self, spec: SandboxSpec, vm: Vm, vm_dir: Path) -> QemuSandbox:
        """The sandbox object for the started ``vm``, not connected yet."""
        raise NotImplementedError

    # -- preparation
    def _check_spec(self, spec: SandboxSpec) -> None:
        """The workspace and the mounts: what every microVM refuses alike."""
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
        name = self._vm_name(spec.name)
        vm_dir = self._vm_dir(name)
        vm_dir.mkdir(mode=0o700)
        write_owner(vm_dir, spec)  # a restarted launcher saves an orphan's /data
        vm: Vm | None = None
        try:
            limit = spec.resources.disk_limit(self.settings)  # /data's ext4: the disk limit
            data = make_data_disk(
                spec.workspace, vm_dir / "data.img", uid=spec.uid,
                size=limit.size, inodes=limit.inodes,
            )  # fmt: skip
            mounts = self._mount_disks(spec, vm_dir)
            cfg = dataclasses.replace(
                self.base_config(spec, vm_dir / "run", data), name=name, mount_disks=mounts
            )
            vm = self._vm(cfg, vm_dir)
            self._start(vm)
            sandbox = self._sandbox(spec, vm, vm_dir)
            sandbox._connect()
            return sandbox
        except BaseException:
            if vm is not None:
                log.warning(
                    "microVM failed to start", backend=self.name, sandbox=name, log=vm.log_tail(800)
                )
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
        for vm_dir, owner in vm_dirs(self.settings):
            disk = vm_dir / "data.img"
            if owner.get(LABEL) != name or not disk.is_file():
                continue
            pid = owner.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
                raise SandboxError("its owner is alive: not recovering", sandbox=name)
            replace_workspace(workspace, functools.partial(export_into, disk, uid=uid))
            saved.append(vm_dir.name)
        return saved

    def owned(self) -> list[str]:
        """Sandboxes with a VM dir under this data dir (``microvm/*/owner`` names them)."""
        names = {str(owner.get(LABEL)) for _, owner in vm_dirs(self.settings)}
        return sorted(n for n in names if n and n != "None")

    def cleanup_orphans(self) -> list[str]:
        """Settle VM dirs whose owning process is gone: kill the VMM, save ``/data``
        into the task workspace it was made from (see :func:`recover_sandbox`), remove."""
        return settle(self.settings, None)
