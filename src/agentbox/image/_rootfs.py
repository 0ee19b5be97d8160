"""Work on a root directory as root without ever leaving it.

A Debian root holds absolute symlinks (``/etc/alternatives/pager`` →
``/usr/bin/less``); followed on the host they would lead to the *host's* files.
Every path here is resolved as if ``root`` were ``/`` (like ``chroot``), and
leaves are inspected with ``lstat`` and changed only when they are not links.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError, ImageError

_MAX_LINKS = 40


def resolve_in(root: Path, path: str) -> Path:
    """Resolve ``path`` inside ``root`` following links as a chroot would.

    Absolute link targets restart at ``root``; ``..`` never climbs above it. A
    missing component ends the resolution (the rest is appended unresolved).
    """
    parts = [p for p in path.split("/") if p and p != "."]
    cur = root
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if cur != root:
                cur = cur.parent
            continue
        nxt = cur / part
        try:
            st = nxt.lstat()
        except FileNotFoundError:
            return nxt.joinpath(*parts)
        except OSError as exc:
            raise ImageError(f"cannot inspect {nxt}: {exc}") from exc
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise ImageError(f"too many symlinks resolving {path} in {root}")
            target = str(nxt.readlink())
            if target.startswith("/"):
                cur = root
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        cur = nxt
    return cur


def resolve_parent_in(root: Path, path: str) -> Path:
    """Resolve the directory of ``path`` inside ``root``; the leaf itself is not followed."""
    head, _, leaf = path.rstrip("/").rpartition("/")
    return resolve_in(root, head) / leaf


def walk(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry under ``root`` (root included) with its ``lstat``; links are not followed."""
    yield root, root.lstat()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError as exc:
            raise ImageError(f"cannot list {d}: {exc}") from exc
        for e in entries:
            st = e.stat(follow_symlinks=False)
            p = Path(e.path)
            yield p, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(p)


def _mounts_under(path: Path) -> list[Path]:
    out = []
    real = str(path.resolve())
    with contextlib.suppress(OSError), Path("/proc/self/mountinfo").open() as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 4:
                mp = fields[4].replace("\\040", " ")
                if mp == real or mp.startswith(real + "/"):
                    out.append(Path(mp))
    return out


def safe_rmtree(path: Path) -> None:
    """Remove a build tree; first detach anything still mounted in it.

    mmdebstrap (root mode) mounts /proc, /sys and /dev pieces into the root
    while it runs; a killed run can leave them, and rmtree must never descend
    into the host's /sys or /dev through them.
    """
    if not path.exists() and not path.is_symlink():
        return
    for mp in sorted(_mounts_under(path), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(AgentboxError):
            _proc.run(["umount", "--lazy", str(mp)], timeout=30)
    if _mounts_under(path):
        raise ImageError(f"refusing to delete {path}: something is still mounted under it")
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    shutil.rmtree(path)
