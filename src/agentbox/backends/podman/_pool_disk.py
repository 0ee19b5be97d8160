"""A pooled sandbox's workspace disk, made ahead: its task's start only fills it.

At fill (:func:`make`, off any task's path) a slot gets an empty ext4 image of the
pool template's disk limit (the options of
:func:`~agentbox.backends.microvm._disks.make_data_disk`, without ``-d``), loop-mounted
``nosuid,nodev,noatime`` at a private stage, ``data_dir/pool-disks/<slot>.d`` (the
data dir's mount: a move out of the shared pool dir is refused). At claim
(:class:`PrebuiltDisk`) the prepared workspace is copied into it by directory fds,
never following a link, keeping what ``mkfs.ext4 -d`` keeps (modes, owners, times,
symlinks, hard links), then the image is renamed to the task's record name in
``disks/`` (the loop device's backing file follows the rename) and the mount moved
over the workspace: from there it is the disk :class:`WorkspaceDisk` would have made,
handed over, settled and copied back as one.

A workspace past :data:`MAX_ENTRIES` or :data:`MAX_BYTES`, holding anything but
directories, files and symlinks, or not fitting, takes ``mkfs.ext4 -d`` as before
(the staged disk dropped). A slot that ends unclaimed drops its disk
(:func:`drop`, from the slot's discard); :func:`sweep` drops those whose slot is gone
or was left half-filled (a filler killed mid-way), run under the pool lock.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import Any

from agentbox.backends import _wsdisk
from agentbox.backends._wsdisk import WorkspaceDisk
from agentbox.backends._wsdisk_copy import _sparse_copy, snapshot
from agentbox.boxfile import DiskLimit
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError
from agentbox.linux.loopdev import loop_mount
from agentbox.linux.mounts import (
    MS_MOVE,
    MS_NOATIME,
    MS_NODEV,
    MS_NOSUID,
    mount,
    umount,
    umount_lazy,
)

log = get_logger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: A prepared workspace copied into the staged disk at claim holds at most this many
#: entries and bytes; a bigger one takes ``mkfs.ext4 -d`` (see the module's measures).
MAX_ENTRIES = 1000
MAX_BYTES = 256 * 1024**2
#: Directories nested deeper than this take ``mkfs.ext4 -d`` (each level holds two fds).
MAX_DEPTH = 64


def disks_root(data_dir: Path) -> Path:
    """``data_dir/pool-disks``: the slots' staged images and their mount points (0700)."""
    return data_dir / "pool-disks"


def _paths(data_dir: Path, slot: str) -> tuple[Path, Path]:
    base = disks_root(data_dir)
    return base / f"{slot}.img", base / f"{slot}.d"


def make(settings: Settings, slot: str, limit: DiskLimit) -> dict[str, Any]:
    """Make ``slot``'s empty disk of ``limit`` and mount it at its stage; what the
    slot's ready record keeps of it (``disk``)."""
    base = disks_root(settings.data_dir)
    base.mkdir(mode=0o700, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(base).st_mode):
        raise SandboxError(f"{base} is not a directory (a link?)")
    image, stage = _paths(settings.data_dir, slot)
    try:
        # The very maker of every workspace disk (microvm's, which podman may not import
        # itself: _wsdisk, the backends' shared disk code, lends it).
        _wsdisk.make_data_disk(None, image, size=limit.size, inodes=limit.inodes, pad=False)
        image.chmod(0o600)
        stage.mkdir(mode=0o700)
        loop_mount(image, stage, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
        top = os.open(stage, _DIR_FLAGS)
        try:
            with contextlib.suppress(OSError):  # mkfs made it; a copy has none
                os.rmdir("lost+found", dir_fd=top)
            os.fchmod(top, 0o700)  # root's until a claim gives it the workspace's owner
            dev = os.fstat(top).st_dev
        finally:
            os.close(top)
    except BaseException:
        drop(settings.data_dir, slot)
        raise
    return {"size": limit.size, "inodes": limit.inodes, "dev": dev}


def drop(data_dir: Path, slot: str) -> None:
    """Unmount and delete ``slot``'s staged disk (nothing if it has none); idempotent."""
    image, stage = _paths(data_dir, slot)
    for how in (umount, umount_lazy):
        if not os.path.ismount(stage):
            break
        try:
            how(stage)
        except OSError as exc:
            log.debug("staged pool disk unmount failed", path=str(stage), error=str(exc))
    with contextlib.suppress(FileNotFoundError):
        stage.rmdir()
    image.unlink(missing_ok=True)


def sweep(data_dir: Path, slots_dir: Path) -> list[str]:
    """Drop staged disks whose slot is gone, or has no record (a filler that died
    mid-way: call it under the pool lock, which every filler holds); their slots."""
    base = disks_root(data_dir)
    if not base.is_dir():
        return []
    dropped = []
    for entry in sorted(base.iterdir()):
        slot = entry.name.rsplit(".", 1)[0]
        sdir = slots_dir / slot
        if slot in dropped or any((sdir / r).exists() for r in ("ready", "claimed", "drained")):
            continue
        drop(data_dir, slot)
        dropped.append(slot)
        log.warning("dropped a staged pool disk whose slot is gone", slot=slot)
    return dropped


#: ``CLOCK_REALTIME_COARSE`` (Linux): the clock a file's ctime is taken from.
_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


def _past(newest_ns: int) -> None:
    """Return once a write from now on gets a later ctime than ``newest_ns``.

    The copy back keeps an entry whose inode and ctime on the disk are what the
    mount-time snapshot saw (:func:`~agentbox.backends._wsdisk_copy.snapshot`). The copy
    here gives every entry its ctime of now (``mkfs -d`` keeps the source's, which
    ``prepare`` made older than any later write), so an agent's write within the same
    tick of the timestamp clock (a few ms) would keep inode and ctime and never be
    copied back: the sandbox is not let go before that tick has passed.
    """
    while time.clock_gettime_ns(_COARSE) <= newest_ns:
        time.sleep(0.0005)


class _NoFastCopy(Exception):
    """The workspace is not for the staged disk: ``mkfs.ext4 -d`` instead."""


class PrebuiltDisk(WorkspaceDisk):
    """A claimed slot's workspace disk: the slot's staged one filled, else a fresh one."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        workspace: Path,
        limit: DiskLimit,
        *,
        slot: str,
        staged: Any,
        detached: bool = False,
    ) -> None:
        super().__init__(settings, name, workspace, limit, detached=detached)
        self._data_dir = settings.data_dir
        self._slot = slot
        self._staged = staged if isinstance(staged, dict) else None

    def mount(self) -> None:
        staged, self._staged = self._staged, None
        image, stage = _paths(self._data_dir, self._slot)
        if (
            staged is None
            or staged.get("size") != self.limit.size
            or staged.get("inodes") != self.limit.inodes
            or os.geteuid() != 0
        ):
            drop(self._data_dir, self._slot)
            super().mount()
            return
        try:
            self._fill(image, stage, int(staged.get("dev", -1)))
        except _NoFastCopy as exc:
            log.info("workspace disk made by mkfs", workspace=str(self.workspace), why=str(exc))
            drop(self._data_dir, self._slot)
            super().mount()
            return
        except BaseException:
            drop(self._data_dir, self._slot)
            raise

    def _fill(self, image: Path, stage: Path, dev: int) -> None:
        if self.image.exists() or self.record.exists():
            raise SandboxError(f"a workspace disk {self.image} already exists", sandbox=self.name)
        if os.path.ismount(self.workspace):
            raise SandboxError(
                f"the workspace {self.workspace} is a mount point (in use by another sandbox?)",
                sandbox=self.name,
            )
        top = os.open(stage, _DIR_FLAGS)
        try:
            if os.fstat(top).st_dev != dev:
                raise _NoFastCopy("the staged disk is not mounted")
            under = os.open(self.workspace, _DIR_FLAGS)
            try:
                st = os.fstat(under)
                try:
                    _Copy(top).tree(under)
                except OSError as exc:  # ENOSPC, a file gone meanwhile: mkfs says it
                    raise _NoFastCopy(f"the copy failed: {exc}") from exc
                os.fchown(top, st.st_uid, st.st_gid)
                os.fchmod(top, stat.S_IMODE(st.st_mode))
                os.utime(top, ns=(st.st_atime_ns, st.st_mtime_ns))
            except BaseException:
                os.close(under)
                raise
        finally:
            os.close(top)
        self._under = under
        # As WorkspaceDisk.mount: the record first, so a death from here on leaves
        # what settle_orphan_disks finds (the image renamed before the mount moves).
        self._write_record()
        image.rename(self.image)
        try:
            mount(stage, Path(f"/proc/{os.getpid()}/fd/{under}"), MS_MOVE)
        except OSError as exc:  # (a data dir on a shared mount refuses it): undo, mkfs
            self.image.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)
            self._created = False
            self._under = None
            os.close(under)
            raise _NoFastCopy(f"cannot move the staged disk: {exc}") from exc
        self._mounted = True
        with contextlib.suppress(OSError):
            stage.rmdir()
        top = os.open(self.workspace, _DIR_FLAGS)
        try:
            if os.fstat(top).st_dev != dev:
                raise SandboxError("the workspace disk did not mount", sandbox=self.name)
        finally:
            os.close(top)
        self._snap = snapshot(self.workspace)
        _past(max((ctime for _, ctime in self._snap.values()), default=0))
        log.info("workspace disk mounted", workspace=str(self.workspace),
                 bytes=self.limit.size, inodes=self.limit.inodes, prebuilt=True)  # fmt: skip


class _Copy:
    """Copies a directory's content into the disk's root, as ``mkfs.ext4 -d`` would."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.entries = 0
        self.bytes = 0
        self.links: dict[tuple[int, int], str] = {}  # (dev, inode) → its first copy's path

    def tree(self, src: int) -> None:
        self._dir(src, self.dst, "", 0)

    def _dir(self, sfd: int, dfd: int, rel: str, depth: int) -> None:
        with os.scandir(sfd) as it:
            entries = list(it)
        for e in entries:
            self.entries += 1
            if self.entries > MAX_ENTRIES:
                raise _NoFastCopy(f"more than {MAX_ENTRIES} entries")
            name = e.name
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if depth >= MAX_DEPTH:
                    raise _NoFastCopy(f"deeper than {MAX_DEPTH} directories")
                os.mkdir(name, 0o700, dir_fd=dfd)
                cs = os.open(name, _DIR_FLAGS, dir_fd=sfd)
                try:
                    cd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                    try:
                        self._dir(cs, cd, f"{rel}{name}/", depth + 1)
                        _meta_fd(cd, st)
                    finally:
                        os.close(cd)
                finally:
                    os.close(cs)
            elif stat.S_ISREG(mode):
                self._file(sfd, dfd, name, f"{rel}{name}", st)
            elif stat.S_ISLNK(mode):
                os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd,
                         follow_symlinks=False)  # fmt: skip
            else:
                raise _NoFastCopy(f"a special file {rel}{name}")

    def _file(self, sfd: int, dfd: int, name: str, path: str, st: os.stat_result) -> None:
        if st.st_nlink > 1:
            first = self.links.get((st.st_dev, st.st_ino))
            if first is not None:
                os.link(first, name, src_dir_fd=self.dst, dst_dir_fd=dfd, follow_symlinks=False)
                return
            self.links[(st.st_dev, st.st_ino)] = path
        self.bytes += st.st_size
        if self.bytes > MAX_BYTES:
            raise _NoFastCopy(f"more than {MAX_BYTES} bytes")
        fin = os.open(name, _READ_FLAGS, dir_fd=sfd)
        try:
            fout = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=dfd)
            try:
                if st.st_size:
                    _copy_data(fin, fout, st.st_size)
                _meta_fd(fout, st)
            finally:
                os.close(fout)
        finally:
            os.close(fin)


def _copy_data(fin: int, fout: int, size: int) -> None:
    """The file's data, its holes kept as holes when it has any (as ``mkfs -d`` does)."""
    if size > 512 * os.fstat(fin).st_blocks:  # sparse: copy only the data extents
        _sparse_copy(fin, fout, size)
        return
    left = size
    while left > 0:
        n = os.sendfile(fout, fin, None, left)
        if n == 0:  # shrank meanwhile: the disk holds what was there
            break
        left -= n


def _meta_fd(fd: int, st: os.stat_result) -> None:
    """Owner, mode (the owner first: chown clears setuid) and times of ``st`` onto ``fd``."""
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
