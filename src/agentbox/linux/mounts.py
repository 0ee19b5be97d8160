"""``mount(2)`` and ``umount2(2)`` on the host, by libc: the flags and the calls the
in-process mounts share (a pool claim's binds and their removal, a workspace disk's
loop mount and unmount), each failure an ``OSError`` that names the call; and what
``/proc/self/mountinfo`` says of a mount point (:func:`is_mount`, :func:`mount_source`)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

from agentbox.linux.libc import libc

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE = 32, 1024, 2048, 4096, 8192
MS_RELATIME = 1 << 21
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8


def mount(source: Path | str | None, target: Path, flags: int, fstype: str | None = None) -> None:
    """``mount(2)`` of ``source`` (None: the remount or move of ``target`` itself)."""
    src = None if source is None else os.fsencode(source)
    kind = None if fstype is None else fstype.encode()
    if libc().mount(src, os.fsencode(target), kind, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} (flags {flags:#x}): {os.strerror(err)}")


def umount(target: Path) -> None:
    """``umount2(target, UMOUNT_NOFOLLOW)``: ``umount``, without its process and without
    following a link in the last component (EBUSY while the mount is in use)."""
    if libc().umount2(os.fsencode(target), UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def umount_lazy(target: Path) -> None:
    """``umount2(target, MNT_DETACH)``: ``umount --lazy``."""
    if libc().umount2(os.fsencode(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount --lazy {target}: {os.strerror(err)}")


def is_mount(path: Path) -> bool:
    """Whether ``path`` is a mount point (a bind of the same filesystem too, which
    ``os.path.ismount`` misses)."""
    want = os.fsencode(path)
    return any(point == want for point, _src in _mounts())


def mount_source(target: Path) -> str:
    """The source of the topmost mount at ``target`` ("" if none)."""
    want = os.fsencode(target)
    src = b""
    for point, source in _mounts():
        if point == want:
            src = source  # later lines: mounted later, on top
    return os.fsdecode(src)


def _mounts() -> Iterator[tuple[bytes, bytes]]:
    """(mount point, source) of each line of this process's mountinfo:
    ``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS``."""
    with open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            fields = line.split(b" ")
            try:
                tail = fields[fields.index(b"-", 6) + 1 :]
            except ValueError:
                continue
            if len(fields) >= 5 and len(tail) >= 2:
                yield _unescape(fields[4]), _unescape(tail[1])


def _unescape(field: bytes) -> bytes:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    for esc, ch in ((b"\\040", b" "), (b"\\011", b"\t"), (b"\\012", b"\n"), (b"\\134", b"\\")):
        field = field.replace(esc, ch)
    return field
