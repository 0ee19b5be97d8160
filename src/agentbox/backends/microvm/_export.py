"""Writing a tar stream from a guest onto the host through the safe path layer.

The archive is hostile input: member names are checked by
:func:`agentbox.safepath.check_name` (no ``..``, no absolute paths, no
control characters), links are recreated as links (only those whose target stays inside the
copy) and never followed,
hard links, devices, FIFOs and sockets are skipped (with ``links="any"``, a
workspace sync, every link is recreated whatever its target, as a bind-mounted
workspace shows it: a venv's ``bin/python -> /usr/bin/python3``; still never
followed), and modes are normalised
(setuid/setgid dropped) by :class:`agentbox.safepath.SafeWriter`. Nothing is
ever extracted with ``tarfile``'s own ``extract``.
"""

from __future__ import annotations

import posixpath
import tarfile
from pathlib import Path
from typing import Literal

from agentbox.backends.microvm._disks import DATA_DISK_BYTES
from agentbox.core.log import get_logger
from agentbox.errors import PathRefused
from agentbox.safepath import SafeWriter

log = get_logger(__name__)

#: Total bytes a copy-out may write (the /data disk's size, the largest disk limit).
MAX_EXPORT_BYTES = DATA_DISK_BYTES
#: Largest single file a copy-out may write.
MAX_EXPORT_FILE = 2 * 1024**3


def _inside(parts: list[str], target: str) -> bool:
    """Whether a link at ``parts`` (relative to the copy) with ``target`` stays inside it."""
    if not target or target.startswith("/"):
        return False
    joined = posixpath.normpath(posixpath.join(*(parts[:-1] or ["."]), target))
    return joined != ".." and not joined.startswith("../")


def write_tar(
    tf: tarfile.TarFile, dest: Path, *, links: Literal["inside", "any"] = "inside"
) -> list[tuple[str, str]]:
    """Write ``tf``'s members (in stream order) under ``dest``; return what was skipped.

    ``links="inside"`` keeps only links whose target stays inside the copy;
    ``"any"`` keeps every link (stored, never resolved).

    The archive's first path component is the copied entry's own name and
    becomes ``dest`` itself. ``dest`` must not exist yet; its parent must.
    """
    if dest.exists() or dest.is_symlink():
        raise PathRefused("copy-out destination exists", path=dest)
    skipped: list[tuple[str, str]] = []
    made_root = False
    with SafeWriter(dest.parent, max_file_size=MAX_EXPORT_FILE,
                    max_total_size=MAX_EXPORT_BYTES) as w:  # fmt: skip
        for m in tf:
            parts = [p for p in m.name.split("/") if p not in ("", ".")]
            if not parts:
                continue
            rel = "/".join([dest.name, *parts[1:]])
            if len(parts) == 1 and not m.isdir():
                if m.isfile():
                    f = tf.extractfile(m)
                    w.write_file(dest.name, f if f is not None else b"", m.mode)
                    made_root = True
                else:
                    skipped.append((m.name, "not a regular file"))
                continue
            if not made_root:
                w.mkdir(dest.name, 0o755)
                made_root = True
            try:
                if m.isdir():
                    w.mkdir(rel, m.mode)
                elif m.isfile():
                    f = tf.extractfile(m)
                    w.write_file(rel, f if f is not None else b"", m.mode)
                elif m.issym():
                    if links == "any" or _inside(parts[1:], m.linkname):
                        w.symlink(rel, m.linkname)
                    else:
                        skipped.append((m.name, "link pointing out of the copy"))
                else:
                    skipped.append((m.name, "hard link" if m.islnk() else "special file"))
            except PathRefused as exc:
                from agentbox.safepath import SizeRefused

                if isinstance(exc, SizeRefused):
                    raise
                skipped.append((m.name, str(exc)))
    if skipped:
        log.info("copy-out skipped entries", dest=str(dest), count=len(skipped))
    return skipped
