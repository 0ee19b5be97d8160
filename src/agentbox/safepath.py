"""Reading and writing files beneath a root without ever following a link out of it.

Everything the sandbox wrote is hostile: a workspace may hold symlinks to
``/etc/shadow``, a directory replaced by a link to ``/``, FIFOs that block a
reader forever, device nodes, setuid files, names with newlines. This module is
the one place that touches such a tree. It resolves every multi-component path
with ``openat2(2)`` and ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`` relative to a directory fd held on the
root, and every final component with ``O_NOFOLLOW`` (plus ``O_EXCL`` when
creating). ``openat2`` has no binding in the standard library; it is called
through ctypes (syscall 437, the same number on every architecture that has
it). A kernel without it (< 5.6) raises :class:`~agentbox.errors.UnsupportedError`
when a :class:`Tree` or :class:`SafeWriter` is opened: there is no path-string
fallback, because the fallback is exactly the bug this module exists to avoid.

API (what other components call)::

    supported() -> bool                         # does this kernel have openat2?
    openat2(dirfd, path, flags, mode=0, resolve=BENEATH) -> int   # raw fd

    with Tree(root) as tree:                    # read side (collection, copy-out)
        for e in tree.walk(prune=lambda rel: rel == b".git"):
            e.path   # bytes, relative, b"/"-joined   e.kind  # Kind.FILE|DIR|SYMLINK|OTHER
            e.mode e.size e.nlink e.ino e.dev e.mtime_ns e.ctime_ns
            e.other  # "fifo" | "socket" | "char device" | "block device" | None
        for prefix, dir_fd, entries in tree.dirs(descend=lambda rel: rel != ".git"):
            ...  # os.DirEntry list; kinds from d_type; de.stat(follow_symlinks=False)
        for prefix, pairs in tree.scan(descend):   # [(name, lstat)] per directory
            ...
        fd = tree.open(e.path)                  # O_RDONLY|O_NOFOLLOW, regular files only
        data = tree.read(e.path, limit=N)       # bytes, SizeRefused past N
        target = tree.readlink(e.path)          # bytes, the link itself, never followed
        st = tree.stat(e.path)                  # lstat beneath the root
        tree.skipped                            # [(path, reason)] of dirs not entered

    with SafeWriter(root, max_file_size=…, max_total_size=…) as w:   # write side
        w.mkdir("a/b")                          # parents made as needed; never through a link
        w.write_file("a/b/c.txt", b"…" | file-like | iterable of bytes, mode=0o755)
        w.symlink("a/link", "../c.txt")         # the link is created, never followed
        w.special("a/dev", "char device")       # always refused (PathRefused)

Names are checked by :func:`check_name`: no ``..``, ``.``, empty or absolute
components, no NUL, no control characters (newline included), each component at
most 255 bytes, the whole path at most 4096. Modes written are normalised as
git would: ``0o755`` if the owner may execute, else ``0o644`` (setuid, setgid and
sticky are dropped). Symlink races are out of scope: collection runs after the
sandbox is stopped, and every open is still ``O_NOFOLLOW``/``RESOLVE_BENEATH``, so
a race can at worst make an open fail, never escape.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import itertools
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Self

from agentbox.errors import PathRefused, SizeRefused, UnsupportedError

__all__ = [
    "MAX_NAME",
    "MAX_PATH",
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
    "Entry",
    "Kind",
    "SafeWriter",
    "SizeRefused",
    "Tree",
    "check_name",
    "git_mode",
    "openat2",
    "show",
    "supported",
]

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
#: The resolve flags every path beneath a root is opened with.
BENEATH = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV
MAX_NAME = 255
MAX_PATH = 4096

_CONTROL = frozenset([*range(0x20), 0x7F])


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
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
        try:
            os.close(openat2(os.open("/", os.O_RDONLY | os.O_DIRECTORY), ".", os.O_PATH))
            _supported = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.E2BIG, errno.EINVAL, errno.EPERM):
                raise
            _supported = False
    return _supported


def _require() -> None:
    if not supported():
        raise UnsupportedError(
            "the kernel lacks openat2(2) with RESOLVE_BENEATH (needs Linux >= 5.6)",
            fix="run agentbox on Linux 5.6 or later",
        )


def check_name(rel: bytes | str) -> list[bytes]:
    """Split a relative path into components, or raise PathRefused.

    Refused: absolute paths, empty, ``.`` or ``..`` components, NUL or control
    characters (a newline in a name breaks every line-based tool a reviewer
    uses), a component over 255 bytes, a path over 4096.
    """
    raw = os.fsencode(rel)
    if not raw or len(raw) > MAX_PATH:
        raise PathRefused("empty or over-long path", path=show(raw))
    if raw.startswith(b"/"):
        raise PathRefused("absolute path", path=show(raw))
    if any(b in _CONTROL for b in raw):
        raise PathRefused("control character in name", path=show(raw))
    parts = raw.split(b"/")
    for part in parts:
        if part in (b"", b".", b".."):
            raise PathRefused("empty, '.' or '..' component", path=show(raw))
        if len(part) > MAX_NAME:
            raise PathRefused("component over 255 bytes", path=show(raw))
    return parts


def show(rel: bytes | str) -> str:
    """A path made safe to print: utf-8 with backslash escapes, control characters escaped."""
    text = os.fsencode(rel).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def git_mode(st_mode: int) -> int:
    """The permission bits git would record: 0o755 if owner-executable, else 0o644."""
    return 0o755 if st_mode & stat.S_IXUSR else 0o644


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


def _open_root(root: Path) -> int:
    # The root path itself is ours (derived and checked by the caller); only its
    # last component must not be a link the sandbox could have swapped in.
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PathRefused(f"cannot open root directory ({exc.strerror})", path=root) from exc


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


Data = bytes | BinaryIO | Iterable[bytes]


@dataclass
class SafeWriter:
    """Create directories, files and symlinks beneath ``root``, never through a link.

    For files a sandbox streams out (the qemu guest agent's export). Every
    method raises :class:`~agentbox.errors.PathRefused` for a bad name, an
    existing entry in the way, or a link on the path, and :class:`SizeRefused`
    past ``max_file_size`` or past ``max_total_size`` summed over this writer;
    a file refused half-way is removed. Nothing is ever overwritten.
    """

    root: Path
    max_file_size: int = 50 << 20
    max_total_size: int = 500 << 20
    written: int = 0
    _fd: int = -1
    _last: tuple[bytes, int] | None = None

    def __post_init__(self) -> None:
        _require()
        self._fd = _open_root(self.root)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the root fd; idempotent."""
        if self._last is not None:
            os.close(self._last[1])
            self._last = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _parent(self, rel: bytes | str, *, make: bool) -> tuple[int, bytes]:
        """An fd on the parent directory of ``rel`` (made if ``make``) and the last name."""
        parts = check_name(rel)
        key = b"/".join(parts[:-1])
        # Files usually arrive grouped by directory: reuse the last parent fd.
        if self._last is not None and self._last[0] == key:
            return os.dup(self._last[1]), parts[-1]
        fd = os.dup(self._fd)
        try:
            for part in parts[:-1]:
                if make:
                    # An existing directory is fine; anything else fails the open below.
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nxt = openat2(fd, part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError as exc:
                    raise PathRefused(
                        f"parent is not a plain directory beneath root ({exc.strerror})",
                        path=show(rel),
                    ) from exc
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        if self._last is not None:
            os.close(self._last[1])
        self._last = (key, os.dup(fd))
        return fd, parts[-1]

    def mkdir(self, rel: bytes | str, mode: int = 0o755) -> None:
        """Make directory ``rel`` and missing parents; an existing directory is fine."""
        parent, name = self._parent(rel, make=True)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
            try:
                fd = openat2(parent, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as exc:
                raise PathRefused(f"not a directory ({exc.strerror})", path=show(rel)) from exc
            try:
                # Directories: owner rwx always (we must write into it), no setgid/sticky.
                os.fchmod(fd, (mode & 0o755) | 0o700)
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    def write_file(self, rel: bytes | str, data: Data, mode: int = 0o644) -> int:
        """Create the regular file ``rel`` (it must not exist) with ``data``; return its size.

        ``data`` is bytes, a binary file object, or an iterable of byte chunks.
        The mode is normalised to 0o644/0o755.
        """
        parent, name = self._parent(rel, make=True)
        try:
            try:
                fd = os.open(
                    name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=parent,
                )
            except OSError as exc:
                raise PathRefused(f"cannot create file ({exc.strerror})", path=show(rel)) from exc
            size = 0
            try:
                for chunk in _chunks(data):
                    size += len(chunk)
                    if size > self.max_file_size:
                        raise SizeRefused(f"file over {self.max_file_size} bytes", path=show(rel))
                    if self.written + size > self.max_total_size:
                        raise SizeRefused(
                            f"total written over {self.max_total_size} bytes", path=show(rel)
                        )
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, git_mode(mode))
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=parent)
                raise
            os.close(fd)
            self.written += size
            return size
        finally:
            os.close(parent)

    def symlink(self, rel: bytes | str, target: bytes | str) -> None:
        """Create the symlink ``rel`` -> ``target``; the target is stored, never resolved."""
        raw = os.fsencode(target)
        if not raw or b"\0" in raw or len(raw) > MAX_PATH:
            raise PathRefused("bad symlink target", path=show(rel))
        parent, name = self._parent(rel, make=True)
        try:
            os.symlink(raw, name, dir_fd=parent)
        except OSError as exc:
            raise PathRefused(f"cannot create symlink ({exc.strerror})", path=show(rel)) from exc
        finally:
            os.close(parent)
        self.written += len(raw)

    def special(self, rel: bytes | str, kind: str) -> None:
        """Refuse a device, FIFO or socket: always raises PathRefused naming ``kind``."""
        raise PathRefused(f"{kind} not copied out of a sandbox", path=show(rel))


def _chunks(data: Data) -> Iterator[bytes]:
    if isinstance(data, bytes | bytearray | memoryview):
        yield bytes(data)
    elif hasattr(data, "read"):
        reader: BinaryIO = data  # type: ignore[assignment]
        while chunk := reader.read(1 << 20):
            yield chunk
    else:
        yield from data
