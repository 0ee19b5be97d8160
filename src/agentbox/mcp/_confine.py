"""A private, read-only view of the filesystem for the unprivileged MCP server.

Done while still root, just before the privilege drop:

* a private mount namespace (``unshare(CLONE_NEWNS)``, propagation private),
  so nothing here leaks back to the host;
* the interpreter and the packages the server runs from stay reachable for the
  target uid even when they live under a directory it may not traverse (on a
  host where Python sits in ``/root``, a 0700 directory): that directory is
  covered with an empty tmpfs into which only the needed paths are bind-mounted
  again, which also hides everything else in it;
* ``/dev/shm`` becomes a small private tmpfs (scratch for a fetch's throw-away
  git config; it dies with the namespace);
* then every mount is made read-only (``mount_setattr(AT_RECURSIVE)``) except
  that scratch dir and the repos root, which is bind-mounted on itself read-write:
  fetching result branches into the user's repos is the only write the MCP
  side does to the host.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import UnsupportedError
from agentbox.linux.libc import libc as load_libc

log = get_logger(__name__)

CLONE_NEWNS = 0x00020000
#: The private writable scratch dir (TMPDIR) of the confined server.
SCRATCH = "/dev/shm"
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
SYS_MOUNT_SETATTR = 442  # x86_64
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise UnsupportedError(f"{what} failed: {os.strerror(err)}")


def _mount(
    libc: ctypes.CDLL,
    src: str | None,
    dst: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    rc = libc.mount(
        src.encode() if src else None,
        dst.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount({src}, {dst}, {fstype}, {flags:#x})")


def _setattr(libc: ctypes.CDLL, path: str, *, set_: int = 0, clr: int = 0) -> None:
    attr = _MountAttr(set_, clr, 0, 0)
    rc = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(-100),  # AT_FDCWD
        path.encode(),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(rc, f"mount_setattr({path})")


def needed_paths() -> list[Path]:
    """What the running server must still read after the drop: Python and its packages."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.exec_prefix)}
    paths.update(Path(p) for p in sys.path if p and Path(p).is_dir())
    paths.add(Path(sys.executable).parent)
    return sorted({p.resolve() for p in paths if p.exists()})


def _can_traverse(st: os.stat_result, uid: int, gids: set[int]) -> bool:
    mode = st.st_mode
    if st.st_uid == uid:
        return bool(mode & stat.S_IXUSR)
    if st.st_gid in gids:
        return bool(mode & stat.S_IXGRP)
    return bool(mode & stat.S_IXOTH)


def _blocking_ancestor(path: Path, uid: int, gids: set[int]) -> Path | None:
    for anc in [*reversed(path.parents), path]:
        if not _can_traverse(anc.stat(), uid, gids):
            return anc
    return None


def confine_filesystem(uid: int, gids: Iterable[int], writable: Iterable[Path]) -> None:
    """Give this process (still root) a private read-only mount view; see the module doc."""
    if os.geteuid() != 0:
        raise UnsupportedError("confine_filesystem needs root (it runs before the drop)")
    libc = load_libc()
    gidset = set(gids)
    # Which needed paths sit below a directory the target may not traverse.
    covers: dict[Path, list[tuple[Path, int]]] = {}
    _check(libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare(CLONE_NEWNS)")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)

    # Opened in the new namespace: a bind source must belong to it (else EINVAL).
    def pin(p: Path) -> tuple[Path, int]:
        return p, os.open(p, os.O_PATH | os.O_CLOEXEC)

    needed = needed_paths()
    for p in needed:
        block = _blocking_ancestor(p, uid, gidset)
        if block is None:
            continue
        if block in (p, Path("/")):
            raise UnsupportedError(f"uid {uid} cannot read {p}, which the MCP server runs from")
        covers.setdefault(block, []).append(pin(p))
    rw = [pin(Path(w).resolve()) for w in writable]
    # Shallowest cover first, so a deeper one is made inside it.
    for block in sorted(covers, key=lambda b: len(b.parts)):
        for parent in covers:
            if parent != block and parent in block.parents:
                raise UnsupportedError(f"nested unreadable directories: {parent} and {block}")
        _mount(libc, "tmpfs", str(block), "tmpfs", 0, "mode=0755,size=64k")
        for p, fd in covers[block]:
            p.mkdir(parents=True, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", str(p), None, MS_BIND | MS_REC)
            os.close(fd)
    for p, fd in rw:
        # mkdir creates something only when p sits under a cover's fresh tmpfs.
        p.mkdir(parents=True, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", str(p), None, MS_BIND | MS_REC)
        os.close(fd)
    # A private scratch dir (git's throw-away config for a fetch), gone with the namespace.
    # /dev/shm, not /tmp: a fresh /tmp would hide repos and data dirs that live there.
    _mount(libc, "tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=4m")
    _setattr(libc, "/", set_=MOUNT_ATTR_RDONLY)
    _setattr(libc, SCRATCH, clr=MOUNT_ATTR_RDONLY)
    for p, _ in rw:
        _setattr(libc, str(p), clr=MOUNT_ATTR_RDONLY, set_=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    os.environ["TMPDIR"] = SCRATCH  # everything else is read-only from here on
    tempfile.tempdir = None
    log.info(
        "filesystem confined",
        covered=[str(c) for c in covers],
        writable=[str(p) for p, _ in rw],
    )
