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

Layout: ``_openat2`` (the syscall, the resolve flags, the root fd), ``_names``
(:func:`check_name`, :func:`show`, :func:`git_mode`), ``_tree`` (the read side,
:class:`Tree`) and ``_writer`` (the write side, :class:`SafeWriter`); this facade
re-exports what other components call.
"""

from __future__ import annotations

from agentbox.errors import SizeRefused
from agentbox.safepath._names import MAX_NAME, MAX_PATH, check_name, git_mode, show
from agentbox.safepath._openat2 import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    openat2,
    supported,
)
from agentbox.safepath._tree import Entry, Kind, Tree
from agentbox.safepath._writer import NO_CLONE, SafeWriter

__all__ = [
    "MAX_NAME",
    "MAX_PATH",
    "NO_CLONE",
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
