"""``openat2(2)`` through ctypes: the resolve flags, the syscall, whether the kernel has it."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from agentbox.errors import PathRefused, UnsupportedError
from agentbox.linux.libc import libc

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
#: The resolve flags every path beneath a root is opened with.
BENEATH = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = libc()
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_supported: bool | None = None


def openat2(
    dirfd: int, path: bytes | str, flags: int, mode: int = 0, resolve: int = BENEATH
) -> int:
    """``openat2(dirfd, path, {flags, mode, resolve})``; returns an fd or raises OSError.

    ``O_CLOEXEC`` is always added. ``mode`` must be 0 unless ``flags`` has
    ``O_CREAT``/``O_TMPFILE`` (the kernel rejects it otherwise).
    """
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    raw = os.fsencode(path)
    while True:
        fd = _syscall(
            ctypes.c_long(SYS_OPENAT2),
            ctypes.c_int(dirfd),
            ctypes.c_char_p(raw),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        # openat2 returns EAGAIN when a concurrent rename makes RESOLVE_BENEATH unsure.
        if err not in (errno.EINTR, errno.EAGAIN):
            raise OSError(err, os.strerror(err), os.fsdecode(raw))


def supported() -> bool:
    """True if the running kernel implements openat2 with the resolve flags we use."""
    global _supported
    if _supported is None:
        root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.close(openat2(root, ".", os.O_PATH))
            _supported = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.E2BIG, errno.EINVAL, errno.EPERM):
                raise
            _supported = False
        finally:
            os.close(root)
    return _supported


def _require() -> None:
    if not supported():
        raise UnsupportedError(
            "the kernel lacks openat2(2) with RESOLVE_BENEATH (needs Linux >= 5.6)",
            fix="run agentbox on Linux 5.6 or later",
        )


def _open_root(root: Path) -> int:
    # The root path itself is ours (derived and checked by the caller); only its
    # last component must not be a link the sandbox could have swapped in.
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PathRefused(f"cannot open root directory ({exc.strerror})", path=root) from exc
