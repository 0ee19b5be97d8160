"""Writing blobs into the shadow dir ourselves, from bytes read through safepath.

One ``git hash-object`` per changed file would cost a process each; a loose
object is just ``zlib("blob <size>\\0" + content)`` stored under its hash, so we
write it directly (to a temp file in the object dir, then ``link`` into place,
as git does). The shadow dir is ours; nothing the agent wrote is parsed here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import zlib
from pathlib import Path


class BlobWriter:
    """Stores blobs as loose objects in ``git_dir/objects`` for one object format."""

    def __init__(self, git_dir: Path, object_format: str = "sha1") -> None:
        if object_format not in ("sha1", "sha256"):
            raise ValueError(f"unknown object format {object_format!r}")
        self.objects = git_dir / "objects"
        self.object_format = object_format

    def hash(self, data: bytes, kind: str = "blob") -> str:
        """The id ``data`` would get as an object of ``kind``, without storing it."""
        h = hashlib.new(self.object_format, b"%s %d\0" % (kind.encode(), len(data)))
        h.update(data)
        return h.hexdigest()

    def write(self, data: bytes, kind: str = "blob", *, oid: str | None = None) -> str:
        """Store ``data`` as an object of ``kind`` (blob, tree, commit) and return its id
        (``oid``: that id, :meth:`hash` of the same ``data`` and ``kind`` made already)."""
        if kind not in ("blob", "tree", "commit"):
            raise ValueError(f"unknown object kind {kind!r}")
        oid = oid or self.hash(data, kind)
        final = self.objects / oid[:2] / oid[2:]
        if final.exists():
            return oid
        final.parent.mkdir(mode=0o755, exist_ok=True)
        comp = zlib.compressobj(1)
        header = b"%s %d\0" % (kind.encode(), len(data))
        payload = comp.compress(header) + comp.compress(data) + comp.flush()
        fd, name = tempfile.mkstemp(prefix="tmp_obj_", dir=final.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            tmp.chmod(0o444)
            # link() fails if a concurrent writer got there first: same content, fine.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, final)
        finally:
            tmp.unlink()
        return oid
