"""The write side: directories, files and symlinks created beneath a root, never through a link."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Self

from agentbox.errors import PathRefused, SizeRefused
from agentbox.safepath._names import MAX_PATH, check_name, git_mode, show
from agentbox.safepath._openat2 import (
    _open_root,
    _require,
    openat2,
)

Data = bytes | BinaryIO | Iterable[bytes]

#: ``ioctl(dst, FICLONE, src)``: share ``src``'s extents copy-on-write (XFS, btrfs, bcachefs).
FICLONE = 0x40049409
#: errnos that mean "this filesystem (pair) cannot clone": the caller writes instead.
NO_CLONE = frozenset(
    {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}
)


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

    def clone_file(
        self, rel: bytes | str, src_fd: int, mode: int = 0o644,
        check: Callable[[int], bool] | None = None,
    ) -> int | None:  # fmt: skip
        """Create the regular file ``rel`` as a reflink clone of ``src_fd``; return its size.

        The clone is an independent copy (copy-on-write): a later write to the
        source never shows in it. ``check(fd)`` may read the new file (an
        ``O_RDWR`` fd) and refuse it: the file is then removed and None
        returned. An ``OSError`` whose errno is in :data:`NO_CLONE` means the
        filesystem cannot clone (nothing is left behind); the size caps apply
        as for :meth:`write_file`.
        """
        parent, name = self._parent(rel, make=True)
        try:
            try:
                fd = os.open(
                    name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=parent,
                )
            except OSError as exc:
                raise PathRefused(f"cannot create file ({exc.strerror})", path=show(rel)) from exc
            keep = False
            try:
                size = os.fstat(src_fd).st_size
                if size > self.max_file_size:
                    raise SizeRefused(f"file over {self.max_file_size} bytes", path=show(rel))
                if self.written + size > self.max_total_size:
                    raise SizeRefused(
                        f"total written over {self.max_total_size} bytes", path=show(rel)
                    )
                fcntl.ioctl(fd, FICLONE, src_fd)
                # The clone's own size: the source may have changed since the fstat.
                size = os.fstat(fd).st_size
                if size > self.max_file_size or (check is not None and not check(fd)):
                    return None
                os.fchmod(fd, git_mode(mode))
                keep = True
            finally:
                os.close(fd)
                if not keep:
                    os.unlink(name, dir_fd=parent)
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
