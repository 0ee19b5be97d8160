"""What git spends making a base, done once per repo and commit: :class:`BaseCache`.

An entry holds, for one commit of one repo (the opened directory's device,
inode and owner, the object format, the commit id: content-keyed, so a new
HEAD or another base is another entry and nothing is ever invalidated in
place), what :func:`~agentbox.collect._prepare.prepare` would otherwise ask
git for on every task:

* the pack that the shallow fetch of the commit stored (commit, trees,
  blobs; checked by ``index-pack`` when it was fetched), hard-linked into each
  new shadow dir with its ``shallow`` file: no ``fetch``, no ``upload-pack``;
* the commit's tree id, its ``ls-tree -r -z`` listing and the index
  ``read-tree`` writes for it;
* a pack of the tree alone (trees and blobs, no commit of the user's), which
  each workspace's ``.git`` gets as a *copy*: a new inode the agent may
  rewrite, never a link or an alternate to anything of ours or the user's.

Entries are written whole in a temporary dir and renamed into place, never
changed after; the cache dir is ours (``0700``), beside the task dirs in the
data dir, and a bad or half-removed entry is only a miss.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentbox.collect._git import RepoDir
from agentbox.core.log import get_logger

log = get_logger(__name__)

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_PACK = re.compile(r"pack-[0-9a-f]{40}([0-9a-f]{24})?")

#: Entries kept per cache, and their bytes in all (the least recently used go first;
#: the newest is kept whatever its size). An entry is about twice its commit's packed size.
KEEP = 16
KEEP_BYTES = 4 << 30


@dataclass(frozen=True)
class Entry:
    """One cached base: its directory and what is in it."""

    path: Path
    tree: str
    pack: str  #: the fetched pack's name (``pack-<hex>``) for the shadow dir
    agent_pack: str  #: the tree-only pack's name for the workspace's ``.git``

    @property
    def listing(self) -> bytes:
        """The tree's ``ls-tree -r -z --full-tree`` output."""
        return (self.path / "ls-tree").read_bytes()

    @property
    def index(self) -> Path:
        """The index ``read-tree`` writes for the tree (copy it, never write it)."""
        return self.path / "index"

    def link_into(self, shadow_git: Path, sha: str) -> None:
        """Give a fresh shadow dir the commit's objects: the pack hard-linked, ``shallow``."""
        dest = shadow_git / "objects" / "pack"
        for ext in (".idx", ".pack"):  # the index last is what git looks for: pack first
            os.link(self.path / (self.pack + ext), dest / (self.pack + ext))
        (shadow_git / "shallow").write_text(sha + "\n")

    def copy_agent_pack(self, dest: Path) -> None:
        """Copy (new inodes, never links) the tree-only pack into ``dest``, a workspace's
        ``.git/objects/pack``."""
        for ext in (".pack", ".idx"):
            shutil.copyfile(self.path / (self.agent_pack + ext), dest / (self.agent_pack + ext))


class BaseCache:
    """The entries under ``root`` (made ``0700`` if missing; refused if it is not ours)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _ok_root(self) -> bool:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.root.lstat()
        except OSError:
            return False
        # Ours and closed: nobody else can have planted or changed an entry.
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077

    @staticmethod
    def key(repo: RepoDir, fmt: str, sha: str) -> str:
        """The entry's name: object format, commit, and the repo directory's identity."""
        st = os.fstat(repo.fd)
        return f"{fmt}-{sha}-{st.st_dev:x}-{st.st_ino:x}-{st.st_uid}"

    def get(self, repo: RepoDir, fmt: str, sha: str) -> Entry | None:
        """The entry for ``sha`` of ``repo``, or None (a miss, or anything amiss)."""
        if not self._ok_root():
            return None
        path = self.root / self.key(repo, fmt, sha)
        try:
            meta = json.loads((path / "entry.json").read_text())
            entry = Entry(path, meta["tree"], meta["pack"], meta["agent_pack"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not (
            isinstance(entry.tree, str) and _HEX.fullmatch(entry.tree)
            and isinstance(entry.pack, str) and _PACK.fullmatch(entry.pack)
            and isinstance(entry.agent_pack, str) and _PACK.fullmatch(entry.agent_pack)
        ):  # fmt: skip
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return entry

    def put(
        self, repo: RepoDir, fmt: str, sha: str, *, shadow_git: Path, tree: str,
        listing: bytes, index: Path, agent_pack: Path,
    ) -> None:  # fmt: skip
        """Store what a prepare that missed computed (best effort: a failure is logged).

        ``shadow_git`` holds exactly one pack (the fetch kept as a pack); ``agent_pack``
        is the tree-only pack's path without its extension.
        """
        if not self._ok_root():
            return
        packs = sorted(p.stem for p in (shadow_git / "objects" / "pack").glob("pack-*.idx"))
        if len(packs) != 1 or not _PACK.fullmatch(packs[0]):
            log.info("base cache: not stored", reason=f"{len(packs)} packs in the shadow dir")
            return
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=self.root))
        try:
            for ext in (".pack", ".idx"):
                src = shadow_git / "objects" / "pack" / (packs[0] + ext)
                os.link(src, tmp / (packs[0] + ext))
                shutil.copyfile(Path(str(agent_pack) + ext), tmp / (agent_pack.name + ext))
            (tmp / "ls-tree").write_bytes(listing)
            shutil.copyfile(index, tmp / "index")
            meta = {"tree": tree, "pack": packs[0], "agent_pack": agent_pack.name}
            (tmp / "entry.json").write_text(json.dumps(meta))
            try:
                tmp.rename(self.root / self.key(repo, fmt, sha))
            except OSError:  # another prepare stored the same entry first: keep theirs
                return
            tmp = None  # type: ignore[assignment]
        except OSError as exc:
            log.info("base cache: not stored", reason=str(exc))
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        self._trim()

    def _trim(self) -> None:
        try:
            entries = [p for p in self.root.iterdir() if not p.name.startswith(".")]
            entries.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        except OSError:
            return
        total = 0
        for i, entry in enumerate(entries):
            try:
                total += sum(f.stat().st_size for f in entry.iterdir())
            except OSError:
                continue
            if i and (i >= KEEP or total > KEEP_BYTES):
                # A prepare linking from it now fails its link and falls back to a fetch.
                shutil.rmtree(entry, ignore_errors=True)
