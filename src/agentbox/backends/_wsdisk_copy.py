"""Copying a workspace disk back into the directory under its mount (step 3 of
:mod:`agentbox.backends._wsdisk`).

The directory under the mount is made to hold what the disk holds, by directory
fds, never following a link: entries whose inode and ctime on the disk are what
they were at mount (:func:`snapshot`, taken before the sandbox started) are left
as they are; the rest is removed or copied as the agent left it. A snapshot can
be saved to a file (:func:`save_snapshot`) so that a process other than the one
that mounted the disk (a detached sandbox's follower) copies back as cheaply.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from agentbox.core.log import get_logger

log = get_logger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Directories nested deeper than this are not copied back (each level holds two fds).
MAX_COPY_DEPTH = 128
_CHUNK = 1 << 20


#: Entries the mount-time snapshot records at most (bounded by the prepared workspace,
#: not by the agent; past it, files are copied back whether changed or not).
MAX_SNAPSHOT = 1_000_000
_Snapshot = dict[str, tuple[int, int]]


def snapshot(mounted: Path) -> _Snapshot:
    """``{relative path: (inode, ctime_ns)}`` of every non-directory on the fresh disk.

    Taken before the sandbox starts. ctime cannot be set from userspace (only by a
    clock change the sandbox cannot make), so an entry whose inode and ctime are
    the same at the end was not touched, and its copy under the mount is kept as
    it is: no copy, and collection's stat cache still knows it.
    """
    snap: _Snapshot = {}
    stack = [""]
    while stack and len(snap) < MAX_SNAPSHOT:
        rel = stack.pop()
        try:
            with os.scandir(mounted / rel if rel else mounted) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            st = e.stat(follow_symlinks=False)
            path = f"{rel}{e.name}"
            if stat.S_ISDIR(st.st_mode):
                stack.append(path + "/")
            else:
                snap[path] = (st.st_ino, st.st_ctime_ns)
    return snap


def copy_back(mounted: Path, under: int, snap: _Snapshot | None = None) -> None:
    """Make the directory ``under`` hold what ``mounted``'s disk holds (see step 3)."""
    top = os.open(mounted, _DIR_FLAGS)
    try:
        _Sync(under, snap or {}).run(top)
    finally:
        os.close(top)


def _remove(dfd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


class _Sync:
    """Walks the disk and the directory under it side by side, by directory fds."""

    def __init__(self, dst: int, snap: _Snapshot) -> None:
        self.dst = dst
        self.snap = snap
        self.links: dict[int, str] = {}  # inode on the disk → a path (under dst) of its copy
        self.skipped = 0
        self.copied = 0
        #: Per directory on the walk's stack: the kind of each entry under the mount.
        self.kinds: list[dict[str, str]] = []

    def run(self, src: int) -> None:
        # (source dir fd, dest dir fd, relative path, names left, stat to apply at the end)
        stack: list[tuple[int, int, str, Iterator[str], os.stat_result | None]] = []
        stack.append((src, self.dst, "", self._enter(src, self.dst), None))
        try:
            while stack:
                sfd, dfd, rel, names, dir_st = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    self.kinds.pop()
                    if dir_st is not None:
                        _set_meta(dfd, "", dir_st, only_changed=True)
                        os.close(sfd)
                        os.close(dfd)
                    continue
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                path = f"{rel}{name}"
                kind = _kind(stat.S_IFMT(st.st_mode))
                if (
                    kind is not None
                    and kind != "d"
                    and self.kinds[-1].get(name) == kind
                    and self.snap.get(path) == (st.st_ino, st.st_ctime_ns)
                ):
                    # Untouched since the disk was made, and the same kind of entry under
                    # it (its listing's d_type: the directory under the mount changes only
                    # by this copy): keep the original, without a stat of it.
                    continue
                try:
                    old: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    old = None
                if stat.S_ISDIR(st.st_mode):
                    if len(stack) > MAX_COPY_DEPTH:
                        self.skipped += 1
                        continue
                    if old is not None and not stat.S_ISDIR(old.st_mode):
                        _remove(dfd, name)
                        old = None
                    if old is None:
                        os.mkdir(name, 0o700, dir_fd=dfd)
                    child_s = os.open(name, _DIR_FLAGS, dir_fd=sfd)
                    try:
                        child_d = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                    except OSError:
                        os.close(child_s)
                        raise
                    stack.append((child_s, child_d, path + "/", self._enter(child_s, child_d), st))
                    continue
                if (
                    old is not None
                    and self.snap.get(path) == (st.st_ino, st.st_ctime_ns)
                    and stat.S_IFMT(old.st_mode) == stat.S_IFMT(st.st_mode)
                ):
                    continue  # untouched since the disk was made: keep the original
                if old is not None:
                    _remove(dfd, name)
                if stat.S_ISREG(st.st_mode):
                    self._file(sfd, dfd, name, path, st)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                    _set_meta(dfd, name, st)
                elif stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                    # Inert on the host (nothing listens, nothing is read); kept so that
                    # collection reports them, as it did for the plain bind mount.
                    os.mknod(name, stat.S_IFMT(st.st_mode) | 0o600, dir_fd=dfd)
                    _set_meta(dfd, name, st)
                else:
                    self.skipped += 1  # a device node: the sandbox cannot make one
        finally:
            for sfd, dfd, _, _, dir_st in stack:
                if dir_st is not None:
                    os.close(sfd)
                    os.close(dfd)
        if self.skipped:
            log.warning("entries not copied back from a workspace disk", count=self.skipped)

    def _enter(self, sfd: int, dfd: int) -> Iterator[str]:
        """The disk directory's names; what only the directory under it holds goes now.
        The kinds of what it keeps are pushed on :attr:`kinds` (popped when it is done)."""
        names = list(_names(sfd))
        keep = set(names)
        kinds: dict[str, str] = {}
        with os.scandir(dfd) as it:
            entries = list(it)
        for e in entries:
            if e.name not in keep:
                _remove(dfd, e.name)
                continue
            if e.is_symlink():
                kinds[e.name] = "l"
            elif e.is_dir(follow_symlinks=False):
                kinds[e.name] = "d"
            elif e.is_file(follow_symlinks=False):
                kinds[e.name] = "f"
        self.kinds.append(kinds)
        return iter(names)

    def _file(self, sfd: int, dfd: int, name: str, path: str, st: os.stat_result) -> None:
        self.copied += 1
        first = self.links.get(st.st_ino) if st.st_nlink > 1 else None
        if first is not None:
            try:
                os.link(first, name, src_dir_fd=self.dst, dst_dir_fd=dfd, follow_symlinks=False)
                return
            except OSError as exc:
                if exc.errno not in (errno.EMLINK, errno.ENAMETOOLONG, errno.ENOENT):
                    raise
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fin = os.open(name, flags, dir_fd=sfd)
        try:
            wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fout = os.open(name, wflags, 0o600, dir_fd=dfd)
            try:
                _sparse_copy(fin, fout, st.st_size)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        _set_meta(dfd, name, st)
        if st.st_nlink > 1:
            self.links[st.st_ino] = path


def _kind(fmt: int) -> str | None:
    """A stat's file type as :meth:`_Sync._enter` names a listing's (None: another kind)."""
    return {stat.S_IFLNK: "l", stat.S_IFDIR: "d", stat.S_IFREG: "f"}.get(fmt)


def _names(dir_fd: int) -> Iterator[str]:
    with os.scandir(dir_fd) as it:
        return iter(sorted(e.name for e in it))


def _sparse_copy(fin: int, fout: int, size: int) -> None:
    """Copy only the data extents (a file ``fallocate``d to the limit costs nothing)."""
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fin, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to the end
                break
            raise
        hole = os.lseek(fin, data, os.SEEK_HOLE)
        while data < hole:
            chunk = os.pread(fin, min(_CHUNK, hole - data), data)
            if not chunk:
                break
            os.pwrite(fout, chunk, data)
            data += len(chunk)
        pos = hole
    os.ftruncate(fout, size)


def _set_meta(dfd: int, name: str, st: os.stat_result, *, only_changed: bool = False) -> None:
    """Owner, mode and times of ``st`` onto ``name`` (the owner first: chown clears setuid).

    With ``only_changed`` (directories kept from before), only what differs is set:
    an untouched directory keeps its ctime, and collection's stat cache its entry.
    """
    mode = stat.S_IMODE(st.st_mode)
    if name:
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(name, mode, dir_fd=dfd)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
        return
    cur = os.fstat(dfd)  # the directory dfd itself
    if not only_changed or (cur.st_uid, cur.st_gid) != (st.st_uid, st.st_gid):
        os.fchown(dfd, st.st_uid, st.st_gid)
    if not only_changed or stat.S_IMODE(cur.st_mode) != mode:
        os.fchmod(dfd, mode)
    # Whole seconds: mkfs.ext4 -d copies times without their nanoseconds.
    if not only_changed or int(cur.st_mtime) != int(st.st_mtime):
        os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))


def save_snapshot(snap: _Snapshot, path: Path) -> None:
    """Write ``snap`` to ``path`` (0600, root's data dir) for a copy back in another process."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(snap, fh, separators=(",", ":"))


def load_snapshot(path: Path) -> _Snapshot:
    """The snapshot :func:`save_snapshot` wrote; empty (copy everything) if it is unreadable."""
    snap: _Snapshot = {}
    with contextlib.suppress(OSError, ValueError):
        raw = json.loads(path.read_text())
        if isinstance(raw, dict):
            for k, v in raw.items():
                if isinstance(k, str) and isinstance(v, list) and len(v) == 2:
                    snap[k] = (int(v[0]), int(v[1]))
    return snap
