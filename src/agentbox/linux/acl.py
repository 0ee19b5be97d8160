"""POSIX access ACLs, read and written as the kernel's xattr (no ``acl`` package needed).

One use: gVisor's gofer opens a runsc sandbox's bind-mount sources as the mapped
container root (host uid ``subid_base``), which is neither the owner nor in the
group of the launcher's private task directories (0710 root:agentbox, 0700 root).
Rather than open them to every local user (``o+x``), that one uid is given search
(``--x``) on them by a named-user ACL entry; nobody else gains anything.

The xattr ``system.posix_acl_access`` is a little-endian header (version 2) and
8-byte entries ``(tag u16, perm u16, id u32)`` sorted by tag, then id.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

__all__ = ["acl_allows", "grant_search"]

_XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF
_ENTRY = struct.Struct("<HHI")


def _read(path: Path) -> list[tuple[int, int, int]] | None:
    """The ACL's entries, or None when the file has none beyond its mode bits."""
    try:
        raw = os.getxattr(path, _XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != _VERSION or (len(raw) - 4) % 8:
        return None
    return [_ENTRY.unpack_from(raw, off) for off in range(4, len(raw), _ENTRY.size)]


def grant_search(path: Path, uid: int) -> None:
    """Give host ``uid`` search (``--x``) on directory ``path``, and nothing more.

    The mode's owner, group and other bits stay what they were (the mask keeps the
    group's bits, plus x). Raises OSError where the filesystem has no ACLs.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    mode = stat.S_IMODE(st.st_mode)
    entries = _read(path) or [
        (_USER_OBJ, (mode >> 6) & 7, _UNDEFINED),
        (_GROUP_OBJ, (mode >> 3) & 7, _UNDEFINED),
        (_OTHER, mode & 7, _UNDEFINED),
    ]
    kept = [e for e in entries if not (e[0] == _USER and e[2] == uid) and e[0] != _MASK]
    named = [e for e in kept if e[0] in (_USER, _GROUP)]
    grant = (_USER, 1 | next((p for t, p, i in entries if t == _USER and i == uid), 0), uid)
    group_obj = next(p for t, p, _ in kept if t == _GROUP_OBJ)
    mask = group_obj | grant[1]
    for _, p, _ in named:
        mask |= p
    out = sorted([*kept, grant, (_MASK, mask, _UNDEFINED)], key=lambda e: (e[0], e[2]))
    blob = struct.pack("<I", _VERSION) + b"".join(_ENTRY.pack(*e) for e in out)
    os.setxattr(path, _XATTR, blob, follow_symlinks=False)


def acl_allows(path: Path, uid: int, perm: int) -> bool:
    """Whether a named-user ACL entry gives ``uid`` all of ``perm`` (1 x, 2 w, 4 r) on
    ``path``, through the mask. Mode bits are the caller's to check."""
    entries = _read(path)
    if entries is None:
        return False
    mine = next((p for t, p, i in entries if t == _USER and i == uid), 0)
    mask = next((p for t, p, _ in entries if t == _MASK), 7)
    return (mine & mask & perm) == perm
