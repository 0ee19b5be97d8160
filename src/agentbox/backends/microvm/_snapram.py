"""A snapshot's RAM: saved as a sparse file, shared by restored VMs as one sealed memfd.

A template VM runs with its RAM mapped shared from a file, so when it is saved
the file holds the guest's memory. :func:`save_ram` copies it into the cache
without its zero pages (a hole reads as zero). :func:`snapshot_ram` loads that
file once per process into a memfd sealed against every write, grow and shrink,
and hands the same fd to every VM restored from it: QEMU maps it private
(``share=off``), so the VMs share each page none of them wrote, and a guest's
write is copied into its own VM's memory. A guest's first touch of a page the
template never used (a hole) adds a zero page to the memfd, shared but never
reclaimed: past :data:`REFILL_SLACK` of them the next restores get a fresh memfd.

Why a sealed memfd rather than the cache file itself: QEMU 7.2 opens its RAM
file read-write even for a private mapping, so the VMM's uid would have to be
able to write the file every other VM reads its untouched pages from, and a
VMM taken over by its guest could change them. The seals make the kernel refuse
every write to the memfd (``write``, a shared writable ``mmap``, ``fallocate``,
``ftruncate``) whoever holds it, while a private writable mapping stays allowed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import SandboxError

log = get_logger(__name__)

PAGE = 4096
_CHUNK = 1 << 20
#: The seals a snapshot's memfd carries: no write, grow or shrink, no seal removed.
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_ZERO = bytes(_CHUNK)
#: The memfd's name (``/proc/<pid>/fd`` shows ``/memfd:<name> (deleted)``).
MEMFD_NAME = "agentbox-snapshot-ram"
#: Zero pages guests may add to a memfd before new restores get a fresh one.
REFILL_SLACK = 128 * 1024**2

_lock = threading.Lock()
_memfds: dict[tuple[str, int, int, int], int] = {}


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The data extents (offset, length) of ``fd``'s first ``size`` bytes."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # only a hole is left
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end - start))
        pos = end
    return out


def save_ram(src: Path, dest: Path) -> int:
    """Copy the template's RAM file ``src`` to ``dest`` without its zero pages (holes),
    synced; return the bytes of data written."""
    written = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(sfd).st_size
        dfd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(dfd, size)
            for start, length in _extents(sfd, size):
                for off in range(start, start + length, _CHUNK):
                    chunk = os.pread(sfd, min(_CHUNK, start + length - off), off)
                    if chunk == _ZERO[: len(chunk)]:
                        continue
                    for i in range(0, len(chunk), PAGE):
                        page = chunk[i : i + PAGE]
                        if page != _ZERO[: len(page)]:
                            os.pwrite(dfd, page, off + i)
                            written += len(page)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return written


def _load(path: Path, size: int) -> int:
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        src = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(src).st_size != size:
                raise SandboxError(f"snapshot RAM {path} is not {size} bytes")
            os.ftruncate(fd, size)
            for start, length in _extents(src, size):
                for off in range(start, start + length, _CHUNK):
                    os.pwrite(fd, os.pread(src, min(_CHUNK, start + length - off), off), off)
        finally:
            os.close(src)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_sealed(fd: int, size: int) -> None:
    """Raise unless ``fd`` is a memfd of ``size`` bytes carrying every seal of :data:`SEALS`."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        actual = os.fstat(fd).st_size
    except OSError as exc:
        raise SandboxError(f"snapshot RAM fd {fd} is not a memfd: {exc}") from exc
    if seals & SEALS != SEALS or actual != size:
        raise SandboxError(f"snapshot RAM fd {fd}: seals {seals:#x}, {actual} bytes")


def snapshot_ram(path: Path, size: int) -> int:
    """The sealed memfd holding the RAM saved at ``path`` (``size`` bytes), loaded on first
    use in this process and kept open for the next VM restored from it (do not close)."""
    st = path.stat()  # a re-saved snapshot is a new file (inode, mtime): a new memfd
    key = (str(path), st.st_ino, st.st_mtime_ns, size)
    with _lock:
        fd = _memfds.get(key)
        if fd is not None and os.fstat(fd).st_blocks > st.st_blocks + REFILL_SLACK // 512:
            # A guest's first touch of a page the template never used allocates a zero
            # page in the memfd (shmem: never reclaimed, and sealed: never punched out).
            # Past the slack the next VMs get a fresh memfd; running ones keep the old.
            os.close(_memfds.pop(key))
            fd = None
        if fd is None:
            for old in [k for k in _memfds if k[0] == key[0]]:  # running VMs keep their maps
                os.close(_memfds.pop(old))
            fd = _load(path, size)
            _memfds[key] = fd
            log.info("snapshot RAM loaded", path=str(path), bytes=size)
        check_sealed(fd, size)
        return fd


def ram_ref(path: Path, size: int) -> dict[str, object]:
    """What another process of ours needs to map the same memfd as this one's restores
    (:func:`adopt_ram`): this pid, the fd, and the file it was loaded from."""
    fd = snapshot_ram(path, size)
    st = path.stat()
    return {"pid": os.getpid(), "fd": fd, "path": str(path), "size": size,
            "ino": st.st_ino, "mtime": st.st_mtime_ns}  # fmt: skip


def adopt_ram(ref: dict[str, object]) -> bool:
    """Open the memfd :func:`ram_ref` describes (``/proc/<pid>/fd/<fd>``: root's own
    processes) and use it for this process's restores of that snapshot, so a detached
    VM's monitor shares its launcher's pages. False (nothing changed) if that process,
    its fd or the file it was loaded from is gone, or the fd is not a sealed memfd."""
    try:
        path, size = Path(str(ref["path"])), int(str(ref["size"]))
        st = path.stat()
        if (st.st_ino, st.st_mtime_ns) != (ref["ino"], ref["mtime"]):
            return False
        fd = os.open(f"/proc/{int(str(ref['pid']))}/fd/{int(str(ref['fd']))}", os.O_RDONLY)
    except (OSError, KeyError, ValueError):
        return False
    try:
        if not str(Path(f"/proc/self/fd/{fd}").readlink()).startswith(f"/memfd:{MEMFD_NAME} "):
            raise SandboxError("not a snapshot memfd")
        check_sealed(fd, size)
    except (OSError, SandboxError):
        os.close(fd)
        return False
    os.set_inheritable(fd, False)
    with _lock:
        key = (str(path), st.st_ino, st.st_mtime_ns, size)
        old = _memfds.pop(key, None)
        _memfds[key] = fd
    if old is not None:
        os.close(old)
    return True


def forget_ram() -> None:
    """Close every memfd :func:`snapshot_ram` holds (running VMs keep their mappings)."""
    with _lock:
        for fd in _memfds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        _memfds.clear()
