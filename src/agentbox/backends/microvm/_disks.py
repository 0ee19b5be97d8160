"""Disk images: the read-only root from an image's root directory, ``/data``, and mounts.

All are ext4 made in userspace with ``mkfs.ext4 -d`` (no loop mount, no
privileges). The root disk is cached by the image's content hash. ``/data``
is an ext4 of the sandbox's disk limit (``[resources] disk``, and ``inodes``),
padded (sparse) to a device of always :data:`DATA_DISK_BYTES`, so a snapshot's
guest, which saw the placeholder's size at boot, sees the same size on every
fresh disk; a write past the filesystem's size fails in the guest with ENOSPC.
The podman backend builds its workspace disk with the same function, unpadded.

A copy-on-write mount (a frozen environment's directory) is built the
same way but cached (:func:`cached_mount_disk`): keyed by its index, the sandbox
uid and the source tree's listing (every entry's path, type, mode, size and
mtime), so every later task with the same frozen environment reuses one disk.

A declared (read-only) mount becomes its own disk, labelled ``agentbox-m<i>``:
a filtered copy of the source directory (regular files, directories and
symlinks only; no device, FIFO or socket; setuid/setgid bits dropped; all owned
by the sandbox uid) in an ext4 of its natural size, padded (sparse) to
:data:`MOUNT_DISK_BYTES` so that, like ``/data``, every mount disk has the size
a snapshot's placeholder had.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from agentbox.backends.microvm._initramfs import ROOT_LABEL
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import CommandError, ImageError, SandboxError

DATA_LABEL = "agentbox-data"
#: Size of every ``/data`` device (sparse: only what is written takes space); the
#: ext4 on it is the disk limit, at most this.
DATA_DISK_BYTES = 64 * 1024**3
#: The largest journal of a data disk (mke2fs would give a 20 GiB disk 128 MiB, written out);
#: small disks get 1/32 of their size, at least 4 MiB.
DATA_JOURNAL_MIB = 32
#: Mount points the guest's /init and agent need in the read-only root.
_MOUNT_POINTS = ("workspace", "opt", "opt/agentbox", "opt/agentbox/vm", "home", "home/agent",
                 "tmp", "run", "proc", "sys", "dev")  # fmt: skip
#: Size every declared-mount disk is padded to (sparse); also the largest mount's ext4.
MOUNT_DISK_BYTES = 64 * 1024**3
#: Declared mounts a microVM takes (each is one virtio-blk device).
MAX_MOUNTS = 8
#: Root disks kept in the cache (one per recently used image).
KEEP_ROOT_DISKS = 3
#: Copy-on-write (frozen environment) disks kept in the cache.
KEEP_COW_DISKS = 8
#: Bumped when the disk layout (mount points, mkfs options) changes: old disks are not reused.
LAYOUT = "v2"


def prune_cache(directory: Path, pattern: str, keep: int, *, used: Path | None = None) -> None:
    """Mark ``used`` as just used and delete all but the ``keep`` most recently used matches.

    Running VMs keep what they opened (a bind mount or fd holds the inode), so
    pruning never pulls a file from under a live sandbox.
    """
    if used is not None:
        with contextlib.suppress(OSError):
            os.utime(used)
    entries = []
    for p in directory.glob(pattern):
        with contextlib.suppress(OSError):
            entries.append((p.stat().st_mtime, p))
    for _, p in sorted(entries, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            p.unlink()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                total += (Path(dirpath) / name).lstat().st_blocks * 512
            except OSError:
                continue
    return total


def ensure_root_disk(settings: Settings, rootfs: Path, key: str) -> Path:
    """The read-only root disk of the image whose content hash is ``key``."""
    if not (rootfs / "usr/bin/python3").exists():
        raise ImageError(f"image root {rootfs} has no usr/bin/python3 (the guest agent needs it)")
    out_dir = settings.cache_dir / "microvm" / "disks"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"root-{LAYOUT}-{key[:32]}.img"
    if out.is_file():
        prune_cache(out_dir, "root-*.img", KEEP_ROOT_DISKS, used=out)
        return out
    with (out_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        size_mib = (_tree_bytes(rootfs) * 5 // 4) // 1024**2 + 96
        _proc.run(
            ["mkfs.ext4", "-q", "-F", "-L", ROOT_LABEL, "-O", "^has_journal", "-m", "0",
             "-E", "root_owner=0:0", "-d", rootfs, tmp, f"{size_mib}M"],
            timeout=900,
        )  # fmt: skip
        missing = [p for p in _MOUNT_POINTS if not (rootfs / p).is_dir()]
        if missing:
            cmds = "".join(f"mkdir /{p}\n" for p in missing)
            _proc.run(["debugfs", "-w", "-f", "-", tmp], input=cmds, timeout=120)
        tmp.chmod(0o644)
        tmp.replace(out)
        prune_cache(out_dir, "root-*.img", KEEP_ROOT_DISKS, used=out)
    return out


def make_data_disk(
    workspace: Path | None,
    out: Path,
    *,
    uid: int = 0,
    size: int = DATA_DISK_BYTES,
    inodes: int | None = None,
    pad: bool = True,
) -> Path:
    """A fresh ``/data`` disk at ``out`` holding a copy of ``workspace`` (or empty).

    Its ext4 is ``size`` bytes (at most :data:`DATA_DISK_BYTES`) with at most
    ``inodes`` files; with ``pad`` the file is then extended (sparse) to
    :data:`DATA_DISK_BYTES`, the device size every snapshot expects. A
    workspace that does not fit is a :class:`SandboxError` saying so.
    """
    size = min(size, DATA_DISK_BYTES) if pad else size
    journal_mib = max(4, min(DATA_JOURNAL_MIB, size // 1024**2 // 32))
    argv: list[str | os.PathLike[str]] = ["mkfs.ext4", "-q", "-F", "-L", DATA_LABEL, "-m", "0",
                                          "-J", f"size={journal_mib}"]  # fmt: skip
    if inodes is not None:
        argv += ["-N", str(inodes)]
    # The file is always new (unlinked below): its journal is a hole that reads as
    # zeros, so mke2fs need not write it out (32 MiB of every disk otherwise).
    ext = "lazy_journal_init=1"
    if workspace is not None:
        # Ownership is copied from the host tree; the guest agent re-owns it to
        # the sandbox uid when the root's owner differs.
        argv += ["-d", workspace]
    else:
        ext += f",root_owner={uid}:{uid}"
    argv += ["-E", ext, out, f"{max(1, size // 1024)}k"]
    out.unlink(missing_ok=True)
    try:
        _proc.run(argv, timeout=900)
    except CommandError as exc:
        out.unlink(missing_ok=True)
        if workspace is not None and ("allocate" in exc.stderr or "space" in exc.stderr):
            raise SandboxError(
                f"the workspace {workspace} does not fit in its disk limit "
                f"({size // 1024**2} MiB, {inodes or 'default'} inodes): raise [resources] disk"
            ) from exc
        raise
    if pad:
        os.truncate(out, DATA_DISK_BYTES)
    return out


def mount_label(index: int) -> str:
    """The ext4 label of the ``index``-th declared mount's disk (≤ 16 bytes)."""
    return f"agentbox-m{index}"


def make_mount_disk(source: Path | None, out: Path, *, index: int, uid: int) -> Path:
    """A read-only mount's disk at ``out`` from ``source`` (``None``: an empty placeholder).

    ``source`` is copied first into a staging dir next to ``out`` without
    following any link, keeping only directories, regular files and symlinks
    (devices, FIFOs and sockets of the host must not reach the guest), with
    setuid/setgid/sticky bits dropped and everything owned by ``uid``, the
    sandbox uid: the guest sees what a workspace copy would show, and nothing
    in it can raise privileges even if ``nosuid``/``nodev`` were lost.
    """
    staging = out.with_name(out.name + ".src")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o755)
    try:
        count = 1
        if source is not None:
            count += _copy_tree(source, staging, uid)
        os.chown(staging, uid, uid)
        size_mib = (_tree_bytes(staging) * 5 // 4) // 1024**2 + 8 + count // 256
        if size_mib * 1024**2 > MOUNT_DISK_BYTES:
            raise SandboxError(
                f"declared mount {source} needs {size_mib} MiB; microVM mounts hold at most "
                f"{MOUNT_DISK_BYTES // 1024**2} MiB"
            )
        out.unlink(missing_ok=True)
        _proc.run(
            ["mkfs.ext4", "-q", "-F", "-L", mount_label(index), "-O", "^has_journal", "-m", "0",
             "-N", str(count + 64), "-E", f"root_owner={uid}:{uid}", "-d", staging, out,
             f"{size_mib}M"],
            timeout=900,
        )  # fmt: skip
        os.truncate(out, MOUNT_DISK_BYTES)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _tree_listing(source: Path) -> str:
    """A digest of ``source``'s listing: each entry's path, type and mode, size, mtime."""
    h = hashlib.sha256()
    for top, dirs, files in os.walk(source, followlinks=False):
        dirs.sort()
        for name in sorted(files) + dirs:
            p = Path(top, name)
            with contextlib.suppress(OSError):
                st = p.lstat()
                rel = p.relative_to(source)
                h.update(f"{rel}\0{st.st_mode}:{st.st_size}:{st.st_mtime_ns}\n".encode(
                    errors="surrogateescape"))  # fmt: skip
    return h.hexdigest()


def cached_mount_disk(settings: Settings, source: Path, *, index: int, uid: int) -> Path:
    """:func:`make_mount_disk` of ``source`` from the cache (built on first use).

    For sources that never change once made (a frozen environment): the key is the
    layout, ``index`` (the disk's label), ``uid`` and the tree's listing, so a source
    that did change is a miss, never a stale disk. Kept: the
    :data:`KEEP_COW_DISKS` most recently used.
    """
    out_dir = settings.cache_dir / "microvm" / "disks"
    out_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{LAYOUT}\0{index}\0{uid}\0{_tree_listing(source)}".encode()).hexdigest()
    out = out_dir / f"cow-{key[:32]}.img"
    if out.is_file():
        prune_cache(out_dir, "cow-*.img", KEEP_COW_DISKS, used=out)
        return out
    tmp = out_dir / f".cow-{key[:32]}.tmp{os.getpid()}"
    try:
        make_mount_disk(source, tmp, index=index, uid=uid)
        tmp.chmod(0o444)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    prune_cache(out_dir, "cow-*.img", KEEP_COW_DISKS, used=out)
    return out


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _copy_tree(src: Path, dst: Path, uid: int) -> int:
    """Copy ``src``'s entries into the existing ``dst`` (see :func:`make_mount_disk`).

    Walks by directory file descriptors, never by path: a directory swapped for
    a link during the copy is refused (``O_NOFOLLOW``), not followed out of the
    source. Iterative, so depth is bounded by ``PATH_MAX``, not the recursion
    limit; open descriptors are bounded by the depth. Returns the number of
    entries copied.
    """
    try:
        top = os.open(src, _DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(f"cannot read declared mount source {src}: {exc}") from exc
    stack: list[tuple[int, Path, Iterator[str]]] = []
    dirs: list[tuple[Path, os.stat_result]] = []

    def enter(fd: int, dest: Path) -> None:
        try:
            with os.scandir(fd) as it:
                names = sorted(e.name for e in it)
        except OSError:
            os.close(fd)
            raise
        stack.append((fd, dest, iter(names)))

    count = 0
    where = src
    try:
        enter(top, dst)
        while stack:
            fd, dest, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(fd)
                continue
            where, d = dest / name, dest / name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                d.mkdir()
                dirs.append((d, st))  # owner, mode, times once its entries are in
                enter(os.open(name, _DIR_FLAGS, dir_fd=fd), d)
                count += 1
                continue
            if stat.S_ISREG(st.st_mode):
                _copy_file(fd, name, d)
            elif stat.S_ISLNK(st.st_mode):
                d.symlink_to(os.readlink(name, dir_fd=fd))
            else:
                continue  # device, FIFO, socket: never carried into a guest
            _set_meta(d, st, uid)
            count += 1
        for d, st in reversed(dirs):
            _set_meta(d, st, uid)
    except OSError as exc:
        raise SandboxError(f"cannot copy {where} for a declared mount: {exc}") from exc
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return count


def _set_meta(path: Path, st: os.stat_result, uid: int) -> None:
    os.lchown(path, uid, uid)
    if not stat.S_ISLNK(st.st_mode):
        path.chmod(stat.S_IMODE(st.st_mode) & 0o777)  # no setuid, setgid or sticky bit
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(dir_fd: int, name: str, dst: Path) -> None:
    # O_NOFOLLOW: a file swapped for a link after the scan is refused, not followed;
    # O_NONBLOCK: one swapped for a FIFO cannot hang the open.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise OSError(f"{name} is no longer a regular file")
        with dst.open("xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
