"""The read side: a directory tree walked, opened and read beneath its root."""

from __future__ import annotations

import enum
import errno
import itertools
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from agentbox.errors import PathRefused, SizeRefused
from agentbox.safepath._names import check_name, show
from agentbox.safepath._openat2 import (
    _open_root,
    _require,
    openat2,
)


class Kind(enum.Enum):
    """What a walked entry is. OTHER covers FIFOs, sockets and devices."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


def _other_name(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "char device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown file type"


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry under the root, as ``lstat`` saw it (links are never followed)."""

    path: bytes
    kind: Kind
    mode: int
    size: int
    nlink: int
    ino: int
    dev: int
    mtime_ns: int
    ctime_ns: int
    other: str | None = None


def _entry(path: bytes, st: os.stat_result) -> Entry:
    m = st.st_mode
    if stat.S_ISREG(m):
        kind, other = Kind.FILE, None
    elif stat.S_ISDIR(m):
        kind, other = Kind.DIR, None
    elif stat.S_ISLNK(m):
        kind, other = Kind.SYMLINK, None
    else:
        kind, other = Kind.OTHER, _other_name(m)
    return Entry(
        path,
        kind,
        m,
        st.st_size,
        st.st_nlink,
        st.st_ino,
        st.st_dev,
        st.st_mtime_ns,
        st.st_ctime_ns,
        other,
    )


@dataclass
class Tree:
    """A directory tree read beneath ``root``: walk it, open, read and readlink in it.

    Holds one fd on the root; use as a context manager (``close`` is idempotent).
    """

    root: Path
    max_depth: int = 256
    max_entries: int = 2_000_000
    """Entries listed over the tree's life past which listing raises SizeRefused."""
    skipped: list[tuple[bytes, str]] = field(default_factory=list)
    _fd: int = -1

    def __post_init__(self) -> None:
        _require()
        self._fd = _open_root(self.root)
        self._dev = os.fstat(self._fd).st_dev
        self._listed = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the root fd; idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def fd(self) -> int:
        """The fd held on the root directory."""
        return self._fd

    def walk(self, prune: Callable[[bytes], bool] | None = None) -> Iterator[Entry]:
        """Yield every entry beneath the root, depth first, without following links.

        A directory is yielded before its contents; ``prune(rel)`` returning True
        for a directory (or anything else) skips it and everything below, silently.
        Entries of kind OTHER (FIFOs, sockets, devices) are yielded, never opened;
        directories that cannot be entered (another filesystem mounted there, too
        deep, a race) are recorded in :attr:`skipped`.
        """
        yield from self._walk(self._fd, b"", 0, prune)

    def _walk(
        self, dfd: int, prefix: bytes, depth: int, prune: Callable[[bytes], bool] | None
    ) -> Iterator[Entry]:
        subdirs: list[bytes] = []
        # scandir on an fd: names are relative to it and DirEntry.stat() is
        # fstatat(dfd, name, AT_SYMLINK_NOFOLLOW), so nothing here resolves a path.
        with os.scandir(dfd) as it:
            entries = self._take(it, prefix)
        for de in entries:
            rel = prefix + os.fsencode(de.name)
            if prune is not None and prune(rel):
                continue
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            e = _entry(rel, st)
            yield e
            if e.kind is Kind.DIR:
                subdirs.append(rel)
        for rel in subdirs:
            if depth + 1 > self.max_depth:
                self.skipped.append((rel, f"directory nested deeper than {self.max_depth}"))
                continue
            name = rel.rpartition(b"/")[2]
            try:
                sub = openat2(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as exc:
                reason = (
                    "another filesystem is mounted there"
                    if exc.errno == errno.EXDEV
                    else f"cannot enter directory ({exc.strerror})"
                )
                self.skipped.append((rel, reason))
                continue
            try:
                yield from self._walk(sub, rel + b"/", depth + 1, prune)
            finally:
                os.close(sub)

    def dirs(
        self, descend: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, int, list[os.DirEntry[str]]]]:
        """Yield ``(prefix, dir_fd, entries)`` for every directory, depth first.

        The fast path of collection. ``prefix`` is ``""`` for the root, else
        ``"a/b/"``; names are ``str`` (``os.fsdecode``: surrogate-escaped bytes
        round-trip through ``os.fsencode``). ``dir_fd`` and the entries'
        ``stat(follow_symlinks=False)`` (an ``fstatat`` on that fd, nothing
        resolved) are valid only until the generator resumes: the kind from
        ``d_type`` (``is_file``/``is_dir``/``is_symlink`` with
        ``follow_symlinks=False``) costs no system call. Each directory is
        opened from the root fd with openat2 (no links, no other filesystem);
        ``descend(rel)`` is asked after the caller has handled the batch.
        Directories that cannot be entered go to :attr:`skipped`.
        """
        stack = [""]
        while stack:
            prefix = stack.pop()
            try:
                fd = (
                    openat2(
                        self._fd,
                        os.fsencode(prefix[:-1]),
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                    )
                    if prefix
                    else os.dup(self._fd)
                )
            except OSError as exc:
                reason = (
                    "another filesystem is mounted there"
                    if exc.errno == errno.EXDEV
                    else f"cannot enter directory ({exc.strerror})"
                )
                self.skipped.append((os.fsencode(prefix[:-1]), reason))
                continue
            try:
                with os.scandir(fd) as it:
                    entries = self._take(it, prefix)
                yield prefix, fd, entries
                depth = prefix.count("/") + 1
                # Still before close: is_dir() may need fstatat on fd (DT_UNKNOWN).
                for de in reversed(entries):
                    if not de.is_dir(follow_symlinks=False):
                        continue
                    rel = prefix + de.name
                    if descend is not None and not descend(rel):
                        continue
                    if depth > self.max_depth:
                        reason = f"directory nested deeper than {self.max_depth}"
                        self.skipped.append((os.fsencode(rel), reason))
                        continue
                    stack.append(rel + "/")
            finally:
                os.close(fd)

    def scan(
        self, descend: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, list[tuple[str, os.stat_result]]]]:
        """Like :meth:`dirs`, with every entry's ``lstat``: ``(prefix, [(name, st), ...])``."""
        for prefix, _fd, entries in self.dirs(descend):
            out: list[tuple[str, os.stat_result]] = []
            for de in entries:
                try:
                    out.append((de.name, de.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
            yield prefix, out

    def _take(self, it: Iterator[os.DirEntry[str]], where: bytes | str) -> list[os.DirEntry[str]]:
        """List a directory, but never more than ``max_entries`` over the whole walk.

        A hostile tree may hold millions of names in one directory; reading
        them all into memory before counting would be the attack.
        """
        left = self.max_entries - self._listed
        entries = list(itertools.islice(it, left + 1))
        self._listed += len(entries)
        if len(entries) > left:
            raise SizeRefused(f"more than {self.max_entries} entries", path=show(where or "."))
        return entries

    def lstat(self, rel: bytes | str) -> Entry:
        """The entry at ``rel`` (a link is described, not followed)."""
        parent, name = self._parent(rel)
        try:
            return _entry(os.fsencode(rel), os.stat(name, dir_fd=parent, follow_symlinks=False))
        finally:
            if parent != self._fd:
                os.close(parent)

    def stat(self, rel: bytes | str) -> os.stat_result:
        """``lstat`` of ``rel`` beneath the root (no link on the way, the last not followed)."""
        parent, name = self._parent(rel)
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        finally:
            if parent != self._fd:
                os.close(parent)

    def _parent(self, rel: bytes | str) -> tuple[int, bytes]:
        parts = check_name(rel)
        if len(parts) == 1:
            return self._fd, parts[0]
        try:
            fd = openat2(self._fd, b"/".join(parts[:-1]), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise PathRefused(
                f"cannot resolve beneath root ({exc.strerror})", path=show(rel)
            ) from exc
        return fd, parts[-1]

    def open(self, rel: bytes | str) -> int:
        """Open the regular file at ``rel`` read-only; the caller closes the fd.

        ``O_NOFOLLOW`` on the last component, ``RESOLVE_BENEATH`` and no links on
        the way; ``O_NONBLOCK`` so a FIFO swapped in cannot block us; anything
        but a regular file is refused after ``fstat``.
        """
        parts = check_name(rel)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
        try:
            fd = openat2(self._fd, b"/".join(parts), flags)
        except OSError as exc:
            raise PathRefused(f"cannot open beneath root ({exc.strerror})", path=show(rel)) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PathRefused("not a regular file", path=show(rel))
        return fd

    def read(self, rel: bytes | str, limit: int) -> bytes:
        """The content of the regular file at ``rel``; SizeRefused past ``limit`` bytes."""
        fd = self.open(rel)
        try:
            chunks: list[bytes] = []
            total = 0
            while chunk := os.read(fd, 1 << 20):
                total += len(chunk)
                if total > limit:
                    raise SizeRefused(f"file over {limit} bytes", path=show(rel))
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def readlink(self, rel: bytes | str) -> bytes:
        """The target of the symlink at ``rel``, as bytes; the link is not followed."""
        parent, name = self._parent(rel)
        try:
            return os.readlink(name, dir_fd=parent)
        except OSError as exc:
            raise PathRefused(f"cannot read link ({exc.strerror})", path=show(rel)) from exc
        finally:
            if parent != self._fd:
                os.close(parent)
