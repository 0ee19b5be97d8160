"""Forking a live QEMU microVM: its memory and its disk, copy-on-write on both.

:func:`freeze` stops the parent VM (QMP ``stop``: the vCPUs halt and QEMU drains and
flushes every disk) and saves it in the snapshot machinery's shape. A parent whose
RAM is a private mapping of a sealed memfd (restored from a snapshot, or a fork)
saves its devices alone (``xen-save-devices-state``: the migration stream without
its RAM section) and its RAM becomes a new sealed memfd (:mod:`._snapram`): the
memfd it maps with the pages it wrote laid over, read by the host from the stopped
process (``/proc/<pid>/pagemap`` and ``mem``); a migration would make QEMU read
every page, and reading a page never touched through a private mapping of a memfd
adds it to that (shared) memfd: up to the VM's memory size, held until every VM
restored from it is gone. A cold-booted parent (anonymous RAM, whose untouched
pages read as the zero page) is migrated whole into a file instead. Then its
``/data`` disk is copied as it stands (sparse: only what is written; a fork's
overlay and base flattened) as the frozen base, and the parent resumes (``cont``)
on its own disk, its guest clock, which stood still while it was stopped, set again.

:func:`fork_vm` then starts each fork as a restore of that state: the parent's
command line and device set (kernel, initramfs, root disk, memory, vCPUs, mount
disks), its own VM dir, uid and cgroup, its RAM that memfd mapped private (the
forks share every page none of them wrote, as VMs restored from one snapshot do; a
cold-booted parent's forks load the RAM from the stream into anonymous memory), and
as ``/data`` a
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
import fcntl
import os
import shutil
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.microvm._disks import DATA_DISK_BYTES
from agentbox.backends.microvm._jail import JailSpec, jail_argv
from agentbox.backends.microvm._qmp import wait_migration
from agentbox.backends.microvm._snapram import PAGE
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
#: The largest device state (no RAM) a VM may save for its forks.
MAX_DEVICE_STATE = 256 * 1024**2
#: Where a fork's frozen base is bound in its jail (its overlay names it as backing).
BASE_IN_JAIL = "/vm/data-base.img"


@dataclasses.dataclass
class Frozen:
    """A live VM's state saved for forks: the migration stream, its ``/data`` as it was
    (raw), its mount disks, its config, and how far its session's stream ids had gone
    (:meth:`Channel.streams_seen`). With ``ram_fd`` (a sealed memfd of its RAM, see
    :func:`_save_devices_and_ram`) the stream holds the devices alone, else the RAM too."""

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
    ram: int | None = None
    try:
        vm.qmp(("stop", None), timeout=60)  # QEMU drains and flushes every disk
        if vm.cfg.ram_fd is not None:
            ram = _save_devices_and_ram(sb, state)
        else:
            _migrate_whole(vm, state)
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
    except BaseException:
        if ram is not None:
            os.close(ram)
        raise
    finally:
        vm.qmp(("cont", None), timeout=60)
        with contextlib.suppress(AgentboxError):  # its clock stood still while stopped
            sb.session.set_clock()
    fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:  # read by each fork's VMM uid through its jail; the dir is root's
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)
    frozen = Frozen(state, base, tuple(mounts), vm.cfg, streams, ram_fd=ram)
    log.info("vm frozen for forks", sandbox=sb.name, state_bytes=state.stat().st_size,
             base_bytes=base.stat().st_blocks * 512,
             ram_bytes=0 if ram is None else os.fstat(ram).st_blocks * 512)  # fmt: skip
    return frozen


def _migrate_whole(vm: Vm, state: Path) -> None:
    """A cold-booted VM (anonymous RAM): migrate it, RAM included, into ``state``."""
    no_ignore = {"capabilities": [{**IGNORE_SHARED, "state": False}]}
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        vm.qmp(
            ("migrate-set-capabilities", no_ignore),
            ("migrate-set-parameters", {"max-bandwidth": 64 * 1024**3}),
            ("getfd", {"fdname": "fork", "fd": fd}),
            ("migrate", {"uri": "fd:fork"}),
            wait_migration(),
            timeout=SAVE_TIMEOUT,
        )  # fmt: skip
    finally:
        os.close(fd)


def _save_devices_and_ram(sb: QemuSandbox, state: Path) -> int:
    """A VM whose RAM is a private mapping of a sealed memfd (restored from a snapshot,
    or a fork): its devices alone into ``state`` (``xen-save-devices-state``), and its RAM
    as a new sealed memfd: the memfd it maps, with the pages it wrote (read through
    ``/proc/<pid>/pagemap`` and ``mem``) laid over. QEMU never reads the RAM itself: its
    migration would touch every page, and each untouched page read through the private
    mapping adds a page to the shared memfd (see :mod:`._snapram`), up to the VM's size."""
    vm = sb.vm
    run_file = vm.cfg.run_dir / "fork-devices"
    where = "/vm/run/fork-devices" if vm.cfg.jail else str(run_file)
    vm.qmp(("xen-save-devices-state", {"filename": where, "live": False}), timeout=SAVE_TIMEOUT)
    try:
        _take_file(run_file, state, MAX_DEVICE_STATE)
    finally:
        run_file.unlink(missing_ok=True)
    return _ram_of(vm.vmm_pid(), vm.cfg.memory_mib * 1024**2)


def _take_file(src: Path, dst: Path, limit: int) -> None:
    """Copy the file the VMM (or a tool in its jail) wrote at ``src`` into a new file of
    root's at ``dst``, at most ``limit`` bytes: never following a link it put there."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(src, flags)
    except OSError as exc:
        raise SandboxError(f"fork: {src.name}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fin:
        st = os.fstat(fin.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise SandboxError(f"fork: {src.name} is not a regular file of at most {limit} bytes")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(out, "wb") as fout:
            while chunk := fin.read(min(1 << 20, limit + 1 - fout.tell())):
                fout.write(chunk)
            if fout.tell() > limit:
                raise SandboxError(f"fork: {src.name} grew past {limit} bytes")


_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61
_PAGES = 1 << 16  # pagemap entries read at once


def _written(e: int) -> bool:
    """A pagemap entry of a page the process wrote: its private copy, here or swapped."""
    return bool(e & _SWAPPED or (e & _PRESENT and not e & _FILE))


def _ram_of(pid: int, size: int) -> int:
    """A sealed memfd of the RAM of stopped VMM ``pid`` (see :func:`_save_devices_and_ram`)."""
    from agentbox.backends.microvm._snapram import MEMFD_NAME, SEALS, _extents

    vmas = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == f"/memfd:{MEMFD_NAME}":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                vmas.append((lo, hi, int(parts[2], 16), parts[0]))
    if not vmas or sum(hi - lo for lo, hi, _, _ in vmas) != size:
        raise SandboxError(f"fork: the VM's RAM mapping was not found in process {pid}")
    new = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(new, size)
        src = os.open(f"/proc/{pid}/map_files/{vmas[0][3]}", os.O_RDONLY | os.O_CLOEXEC)
        try:  # the memfd it maps: its data (a hole reads as zero and is left a hole)
            for start, length in _extents(src, size):
                for off in range(start, start + length, 1 << 20):
                    os.pwrite(new, os.pread(src, min(1 << 20, start + length - off), off), off)
        finally:
            os.close(src)
        pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:  # the pages it wrote, laid over
            for lo, hi, offset, _ in vmas:
                for first in range(lo // PAGE, hi // PAGE, _PAGES):
                    n = min(_PAGES, hi // PAGE - first)
                    entries = struct.unpack(f"<{n}Q", os.pread(pagemap, n * 8, first * 8))
                    i = 0
                    while i < n:
                        if not _written(entries[i]):
                            i += 1
                            continue
                        j = i + 1
                        while j < n and j - i < 256 and _written(entries[j]):
                            j += 1
                        addr = (first + i) * PAGE
                        os.pwrite(new, os.pread(mem, (j - i) * PAGE, addr), offset + addr - lo)
                        i = j
        finally:
            os.close(pagemap)
            os.close(mem)
        fcntl.fcntl(new, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(new)
        raise
    return new


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
        flat = where / "flat.img"  # made by a uid of the jail's: a plain file, or refused
        st = flat.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise SandboxError("fork: the flattened disk is not a plain file")
        flat.rename(out)
    except CommandError as exc:
        raise SandboxError(f"fork: flattening the disk failed: {exc.stderr[-300:]}") from exc
    finally:
        shutil.rmtree(where, ignore_errors=True)


def fork_vm(frozen: Frozen, *, name: str, vm_dir: Path, uid: int) -> Vm:
    """A VM for one fork of ``frozen`` in the new ``vm_dir``, as ``uid``, not started; the
    caller starts it with :func:`start_fork` and restores it as a sandbox restored from a
    snapshot is (``wait_incoming``), then greets it with ``rekey``."""
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
    """Start ``vm`` (from :func:`fork_vm`) loading ``frozen``'s state: with a RAM memfd,
    the devices alone, its RAM that memfd mapped private (as a snapshot restore maps
    its template's); else the whole stream, into anonymous RAM under the parent's memory
    backend id if it had one (the stream's RAM block is named after it)."""
    if frozen.ram_fd is not None:
        vm.cfg.ram_fd = frozen.ram_fd
        # xen-save-devices-state's stream: no configuration section, no device description
        vm.cfg.extra_args = (*vm.cfg.extra_args, "-global", "migration.send-configuration=off",
                             "-machine", "suppress-vmdesc=on")  # fmt: skip
    else:
        vm.cfg.ram_anon = frozen.cfg.ram_anon or frozen.cfg.ram_file is not None
    fd = os.open(frozen.state, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
