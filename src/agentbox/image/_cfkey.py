"""The content key of an image built from a Containerfile: what goes into it.

The Containerfile's bytes, every entry of the build context (path, type, mode,
content), the ids of the images it builds ``FROM``, the Claude Code and guest
versions, the sandbox uid and the hardening version: change any and the key
changes, so the cached image is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from agentbox.errors import ImageError
from agentbox.image import _keys

#: Bump when the way a Containerfile image is made changes.
CONTAINERFILE_VERSION = "1"
_MAX_CONTEXT_FILES = 200_000

_FROM_RE = re.compile(r"^\s*FROM\s+(.*)$", re.IGNORECASE)


def from_images(text: str) -> list[str]:
    """The image references a Containerfile builds ``FROM`` (stage names and scratch left out)."""
    stages: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        m = _FROM_RE.match(line)
        if not m:
            continue
        words = [w for w in m.group(1).split() if not w.startswith("--")]
        if not words:
            continue
        ref = words[0]
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        if ref.lower() in stages or ref.lower() == "scratch":
            continue
        out.append(ref)
    return list(dict.fromkeys(out))


def _context_entries(context: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    stack = [context]
    count = 0
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            raise ImageError(f"cannot list the build context {d}: {exc}") from exc
        for e in entries:
            count += 1
            if count > _MAX_CONTEXT_FILES:
                raise ImageError(
                    f"build context {context} holds more than {_MAX_CONTEXT_FILES} entries: "
                    "give a smaller --context"
                )
            st = e.stat(follow_symlinks=False)
            p = Path(e.path)
            yield str(p.relative_to(context)), st, p
            if stat.S_ISDIR(st.st_mode):
                stack.append(p)


def context_digest(context: Path) -> str:
    """sha256 over every entry of the build context: path, type, mode and content."""
    h = hashlib.sha256()
    for rel, st, p in sorted(_context_entries(context), key=lambda t: t[0]):
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0".encode())
        if stat.S_ISREG(st.st_mode):
            try:
                with p.open("rb") as fh:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
            except OSError as exc:
                raise ImageError(f"cannot read the build context file {p}: {exc}") from exc
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.fsencode(p.readlink()))
        h.update(b"\n")
    return h.hexdigest()


def containerfile_key(
    text: bytes,
    context: Path,
    from_ids: dict[str, str],
    *,
    claude_version: str,
    claude_digest: str,
    guest: dict[str, str],
    sandbox_uid: int,
) -> str:
    """The content key of an image built from a Containerfile."""
    blob = json.dumps(
        {
            "kind": "containerfile",
            "version": CONTAINERFILE_VERSION,
            "containerfile": hashlib.sha256(text).hexdigest(),
            "context": context_digest(context),
            "from": dict(sorted(from_ids.items())),
            "claude": [claude_version, claude_digest],
            "guest": dict(sorted(guest.items())),
            "uid": sandbox_uid,
            "hardening": _keys.HARDENING_VERSION,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
