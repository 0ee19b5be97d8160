"""Forking a live QEMU microVM: its memory and its disk, copy-on-write on the disk.

:func:`freeze` stops the parent VM (QMP ``stop``: the vCPUs halt and QEMU flushes
every disk), migrates its whole state, the RAM included, into a file (``migrate
fd:``, as :mod:`._snapshot` saves a template, but without ``x-ignore-shared``: a
live VM's RAM is its own private pages, not a shared file), copies its ``/data``
disk as it stands then (sparse: only what is written) as the frozen base, and
resumes the parent (``cont``: QEMU takes its disks back after a completed
migration), which keeps working on its own disk; its guest clock, which stood still
while it was stopped, is set again.

:func:`fork_vm` then starts each fork as a restore of that state: the parent's
command line and device set (kernel, initramfs, root disk, memory, vCPUs, mount
disks), its own VM dir, uid and cgroup, its RAM anonymous (under the parent's
memory backend id, if it had one) and filled from the stream, and as ``/data`` a
qcow2 overlay whose backing file is the frozen base, bound read-only into the jail
(every fork shares the base's blocks; its writes go to its overlay). The guest
wakes as its parent was, already greeted, so the host sends ``rekey`` (a fresh
token, the clock, an RNG reseed; see :meth:`GuestSession.rekey`) and numbers its
streams past the parent's, so what the parent's commands still send
is dropped. Processes, tmpfs files and memory of the parent live on in every
fork; what the parent's userspace drew from its RNG before the fork (a Python
``random`` state) is the same in all, as after ``os.fork``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.microvm._disks import DATA_DISK_BYTES
from agentbox.backends.microvm._jail import JailSpec, jail_argv
from agentbox.backends.microvm._qmp import wait_migration
from agentbox.backends.microvm._snapshot import IGNORE_SHARED
from agentbox.backends.microvm._vm import Vm, VmConfig
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, CommandError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.microvm.qemu._sandbox import QemuSandbox

log = get_logger(__name__)

#: How long saving a live VM's state may take (its RAM crosses a pipe; under TCG).
SAVE_TIMEOUT = 600.0
#: Where a fork's frozen base is bound in its jail (its overlay names it as backing).
BASE_IN_JAIL = "/vm/data-base.img"


@dataclasses.dataclass
class Frozen:
    """A live VM's state saved for forks: the migration stream, its ``/data`` as it was
    (raw), its mount disks, its config, and how far its session's stream ids had gone
    (:meth:`Channel.streams_seen`). With ``ram_fd`` (a sealed memfd of its RAM, see
    :func:`_share_ram`) the stream holds the devices alone, else the RAM too."""

    state: Path
    base: Path
    mounts: tuple[Path, ...]
    cfg: VmConfig
    streams: tuple[int, int]
    ram_fd: int | None = None

    def close(self) -> None:
        """Let go of the RAM memfd (forks keep their mappings of it); idempotent."""
        if self.ram_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.ram_fd)
            self.ram_fd = None


def freeze(sb: QemuSandbox, into: Path) -> Frozen:
    """Save ``sb``'s VM into the (root-only) directory ``into`` and resume it."""
    vm = sb.vm
    if sb.session is None or not sb.alive():
        raise SandboxError("fork: the VM is not running", sandbox=sb.name)
    if vm.cfg.data_disk is None:
        raise SandboxError("fork: the VM has no /data disk", sandbox=sb.name)
    state, base = into / "state", into / "base.img"
    no_ignore = {"capabilities": [{**IGNORE_SHARED, "state": False}]}
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            vm.qmp(
                ("stop", None),
                ("migrate-set-capabilities", no_ignore),
                ("migrate-set-parameters", {"max-bandwidth": 64 * 1024**3}),
                ("getfd", {"fdname": "fork", "fd": fd}),
                ("migrate", {"uri": "fd:fork"}),
                wait_migration(),
                timeout=SAVE_TIMEOUT,
            )  # fmt: skip
            os.fsync(fd)
        finally:
            os.close(fd)
        # Stopped and migrated: QEMU flushed the disks and lets go of them until `cont`.
        streams = sb.session.channel.streams_seen
        if vm.cfg.data_base is None:
            _sparse_copy(vm.cfg.data_disk, base)
        else:  # a fork forked again: its overlay and base flattened into one raw base
            _flatten(vm.cfg.data_disk, vm.cfg.data_base, base, uid=vm.cfg.uid)
        mounts = []
        for i, disk in enumerate(vm.cfg.mount_disks):
            if disk.parent == sb.vm_dir:  # the VM's own (a declared mount): copied per fork
                _sparse_copy(disk, into / f"m{i}.img")
                mounts.append(into / f"m{i}.img")
            else:  # a cached, shared, never-written disk (a frozen environment's)
                mounts.append(disk)
    finally:
        vm.qmp(("cont", None), timeout=60)
        with contextlib.suppress(AgentboxError):  # its clock stood still while stopped
            sb.session.set_clock()
    frozen = Frozen(state, base, tuple(mounts), vm.cfg, streams)
    if vm.cfg.ram_fd is not None or vm.cfg.ram_file is not None or vm.cfg.ram_anon:
        frozen = _share_ram(frozen, into)  # the parent runs on meanwhile
    base.chmod(0o444)  # read by each fork's VMM uid through its jail; the dir is root's
    log.info("vm frozen for forks", sandbox=sb.name, state_bytes=frozen.state.stat().st_size,
             base_bytes=base.stat().st_blocks * 512,
             ram_shared=frozen.ram_fd is not None)  # fmt: skip
    return frozen


def _share_ram(frozen: Frozen, into: Path) -> Frozen:
    """The snapshot machinery's shape for ``frozen``: a loader VM, never run, takes the
    whole stream into RAM mapped shared from a file, then saves its devices alone
    (``x-ignore-shared``, as a template is saved); that file is loaded into a sealed
    memfd (:mod:`._snapram`) which every fork maps private, so forks share each page
    none of them wrote, as VMs restored from one snapshot do."""
    from agentbox.backends.microvm._snapram import _load
    from agentbox.backends.microvm._snapshot import wait_incoming

    cfg = frozen.cfg
    ram = into / "ram.img"
    ram.touch(mode=0o600)
    os.chown(ram, cfg.uid, cfg.gid)
    state = into / "devices"
    fd = os.open(frozen.state, os.O_RDONLY | os.O_CLOEXEC)
    loader = Vm(dataclasses.replace(
        cfg, name=f"{cfg.name[:50]}-load", run_dir=into / "run", data_disk=frozen.base,
        data_base=None, mount_disks=frozen.mounts, ram_file=ram, ram_fd=None, ram_anon=False,
        incoming_fd=fd, marker=False,
    ))  # fmt: skip
    try:
        try:
            loader.start()
        finally:
            os.close(fd)
        wait_incoming(loader, timeout=SAVE_TIMEOUT, ignore_shared=False, cont=False)
        out = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            loader.qmp(
                ("migrate-set-capabilities", {"capabilities": [IGNORE_SHARED]}),
                ("migrate-set-parameters", {"max-bandwidth": 64 * 1024**3}),
                ("getfd", {"fdname": "devices", "fd": out}),
                ("migrate", {"uri": "fd:devices"}),
                wait_migration(),
                timeout=SAVE_TIMEOUT,
            )  # fmt: skip
        finally:
            os.close(out)
    finally:
        loader.kill()
    memfd = _load(ram, cfg.memory_mib * 1024**2)
    ram.unlink()
    frozen.state.unlink()
    return dataclasses.replace(frozen, state=state, ram_fd=memfd)


def _sparse_copy(src: Path, dst: Path) -> None:
    try:
        _proc.run(["cp", "--sparse=always", "--reflink=auto", "--", str(src), str(dst)],
                  timeout=SAVE_TIMEOUT)  # fmt: skip
    except CommandError as exc:
        raise SandboxError(f"fork: copying {src.name} failed: {exc.stderr[-300:]}") from exc


def _flatten(overlay: Path, backing: Path, out: Path, *, uid: int) -> None:
    """``overlay`` (qcow2, VMM-written) over ``backing`` (raw) as one raw disk at ``out``:
    ``qemu-img convert`` in the VMM's jail as ``uid``, the backing named here, never
    taken from the overlay's header."""
    where = out.parent / "flat"
    where.mkdir(mode=0o700)
    os.chown(where, uid, uid)
    opts = ("driver=qcow2,file.filename=/vm/data.img,file.locking=off,backing.driver=raw,"
            f"backing.file.filename={BASE_IN_JAIL},backing.file.locking=off")  # fmt: skip
    inner = ["qemu-img", "convert", "-q", "-O", "raw", "--image-opts", opts, "/vm/out/flat.img"]
    spec = JailSpec(((overlay, "/vm/data.img"), (backing, BASE_IN_JAIL)), ((where, "/vm/out"),),
                    uid, uid)  # fmt: skip
    try:
        _proc.run(jail_argv(spec, inner), timeout=SAVE_TIMEOUT)
        (where / "flat.img").rename(out)
    except CommandError as exc:
        raise SandboxError(f"fork: flattening the disk failed: {exc.stderr[-300:]}") from exc
    finally:
        shutil.rmtree(where, ignore_errors=True)


def fork_vm(frozen: Frozen, *, name: str, vm_dir: Path, uid: int) -> Vm:
    """A VM for one fork of ``frozen`` in the new ``vm_dir``, as ``uid``, not started; the
    caller starts it with :func:`start_fork` and restores it as a sandbox restored from a
    snapshot is (``wait_incoming(ignore_shared=False)``), then greets it with ``rekey``."""
    base = vm_dir / "data-base.img"
    os.link(frozen.base, base)  # one inode for every fork; each dir holds a link
    data = vm_dir / "data.img"
    backing = BASE_IN_JAIL if frozen.cfg.jail else str(base)
    try:
        _proc.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", backing, "-u",
                   str(data), str(DATA_DISK_BYTES)], timeout=120)  # fmt: skip
    except CommandError as exc:
        raise SandboxError(f"fork: qemu-img create failed: {exc.stderr[-300:]}") from exc
    mounts = []
    for i, disk in enumerate(frozen.mounts):
        if disk.parent == frozen.state.parent:
            _sparse_copy(disk, vm_dir / f"m{i}.img")
            mounts.append(vm_dir / f"m{i}.img")
        else:
            mounts.append(disk)
    cfg = dataclasses.replace(
        frozen.cfg, name=name, run_dir=vm_dir / "run", data_disk=data, data_base=base,
        mount_disks=tuple(mounts), uid=uid, gid=uid, incoming_fd=None, ram_file=None,
        ram_fd=None, marker=False,
    )  # fmt: skip
    return Vm(cfg)


def start_fork(vm: Vm, frozen: Frozen) -> None:
    """Start ``vm`` (from :func:`fork_vm`) loading ``frozen``'s state: its RAM mapped
    private from ``frozen``'s sealed memfd when there is one, else anonymous, filled
    from the stream, under the parent's memory backend id if it had one (the stream's
    RAM block is named after it)."""
    if frozen.ram_fd is not None:
        vm.cfg.ram_fd = frozen.ram_fd
    else:
        vm.cfg.ram_anon = frozen.cfg.ram_anon or (
            frozen.cfg.ram_fd is not None or frozen.cfg.ram_file is not None
        )
    fd = os.open(frozen.state, os.O_RDONLY | os.O_CLOEXEC)
    vm.cfg.incoming_fd = fd
    try:
        vm.start()
    finally:
        os.close(fd)


#: How :func:`freeze`'s directories are named (in the data dir's ``microvm``).
FROZEN_PREFIX = ".fork-"


def remove_stale_frozen(vm_root: Path) -> list[str]:
    """Remove the saved states a launcher that died while forking left in ``vm_root``
    (call before this one forks: forks keep their own links to a base)."""
    gone = []
    with contextlib.suppress(OSError):
        for d in vm_root.glob(f"{FROZEN_PREFIX}*"):
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    return gone
