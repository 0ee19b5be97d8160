"""Writing the workspace's stat data into the base index (git's index format v2/v3).

``git read-tree`` gives an index of the base tree with its cache-tree but no
stat data. We fill each entry's stat fields from our own ``lstat`` of the
workspace at the trusted moment (so no file is read again, and no
``.gitattributes`` consulted) and recompute the trailing checksum. Two choices
keep ``git diff-files`` from ever *reading* a workspace file later (reading
would consult the agent's ``.gitattributes`` files, which may be FIFOs):

* an empty file is recorded with size 1: git reads the content of a changed
  entry only when its recorded size is 0, so empty files are always reported
  as changed instead, and we compare them ourselves;
* collection sets the index's mtime past the snapshot's newest second, so no
  entry is "racily clean" (git's other content check).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from agentbox.errors import CollectError

_STAT = struct.Struct(">10I")
_M32 = 0xFFFFFFFF


def _entries(
    buf: bytes | bytearray, count: int, version: int, hlen: int
) -> Iterator[tuple[int, int, bytes]]:
    """``(offset, flags, path)`` of each of the ``count`` entries of an index ``buf`` of
    format ``version`` (2 or 3); :class:`struct.error` or :class:`ValueError` past its end."""
    off = 12
    for _ in range(count):
        flags_at = off + 40 + hlen
        (flags,) = struct.unpack_from(">H", buf, flags_at)
        name_at = flags_at + 2 + (2 if version == 3 and flags & 0x4000 else 0)
        namelen = flags & 0xFFF
        if namelen == 0xFFF:
            namelen = buf.index(b"\0", name_at) - name_at
        yield off, flags, bytes(buf[name_at : name_at + namelen])
        # Entries are padded with 1-8 NULs to a multiple of 8 bytes.
        off += (name_at - off + namelen + 8) & ~7


def fill_stat(index: Path, stats: dict[bytes, os.stat_result], object_format: str) -> int:
    """Fill the stat fields of ``index`` entries named in ``stats``; return how many."""
    hlen = 32 if object_format == "sha256" else 20
    buf = bytearray(index.read_bytes())
    if buf[:4] != b"DIRC":
        raise CollectError(f"not a git index: {index}")
    version, count = struct.unpack_from(">II", buf, 4)
    if version not in (2, 3):
        raise CollectError(f"unsupported index version {version}: {index}")
    filled = 0
    for off, _, name in _entries(buf, count, version, hlen):
        st = stats.get(name)
        if st is not None:
            mode = struct.unpack_from(">I", buf, off + 24)[0]  # keep git's normalised mode
            _STAT.pack_into(
                buf, off,
                st.st_ctime_ns // 1_000_000_000 & _M32, st.st_ctime_ns % 1_000_000_000,
                st.st_mtime_ns // 1_000_000_000 & _M32, st.st_mtime_ns % 1_000_000_000,
                st.st_dev & _M32, st.st_ino & _M32, mode, st.st_uid & _M32, st.st_gid & _M32,
                (st.st_size & _M32) or 1,
            )  # fmt: skip
            filled += 1
    buf[-hlen:] = hashlib.new(object_format, bytes(buf[:-hlen])).digest()
    tmp = index.with_name(index.name + ".fill")
    tmp.write_bytes(buf)
    tmp.rename(index)
    return filled


#: A base index at most this size is read for its entries' ids (about a millisecond):
#: collection then drops a file it read whose blob is the base's (see :func:`base_entries`).
SMALL_INDEX = 64 * 1024


def base_entries(index: Path, object_format: str) -> dict[bytes, tuple[int, str]] | None:
    """``{path: (git mode, object id)}`` of the base index's entries (ours, from
    ``read-tree``); None when it is larger than :data:`SMALL_INDEX` or not a v2/v3 index
    (the caller then keeps every file it read as a change, as before)."""
    hlen = 32 if object_format == "sha256" else 20
    try:
        if index.stat().st_size > SMALL_INDEX:
            return None
        buf = index.read_bytes()
    except OSError:
        return None
    if buf[:4] != b"DIRC":
        return None
    version, count = struct.unpack_from(">II", buf, 4)
    if version not in (2, 3):
        return None
    out: dict[bytes, tuple[int, str]] = {}
    try:
        for off, flags, name in _entries(buf, count, version, hlen):
            if not flags & 0x3000:  # stage 0 only (a read-tree index has no other)
                (mode,) = struct.unpack_from(">I", buf, off + 24)
                out[name] = (mode, buf[off + 40 : off + 40 + hlen].hex())
    except (struct.error, ValueError):
        return None
    return out
