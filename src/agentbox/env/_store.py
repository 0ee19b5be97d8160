"""Frozen environments on the host: ``cache_dir/envs/<key>/{tree,meta.json}``.

A frozen environment is written once (:meth:`EnvStore.freeze`: built in a
staging directory, then renamed into place, so a reader never sees half of
one and two tasks that froze the same key keep the first) and never changed
afterwards: tasks see it only as the read-only lower layer of an overlay
(:mod:`._mount`). ``envs/`` is root's, 0700. :meth:`EnvStore.remove` refuses an
environment a live overlay still uses.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.env._model import EnvInfo
from agentbox.errors import AgentboxError, PathRefused

log = get_logger(__name__)

_KEY_CHARS = frozenset("0123456789abcdef")


def tree_size(root: Path, *, strip_setid: bool = False) -> tuple[int, int]:
    """``(files, bytes)`` of the regular files under ``root`` (links never followed).

    With ``strip_setid``, setuid/setgid bits are dropped on the way (what setup made is
    untrusted: a program setuid to the sandbox's host uid has no place on the host).
    """
    files = size = 0
    for top, _dirs, names in os.walk(root, followlinks=False):
        for name in names:
            p = Path(top) / name
            with contextlib.suppress(OSError):
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                files += 1
                size += st.st_size
                if strip_setid and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    p.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    return files, size


def _check_key(key: str) -> str:
    if not 8 <= len(key) <= 64 or not set(key) <= _KEY_CHARS:
        raise PathRefused(f"not an environment key: {key!r:.80}")
    return key


class EnvStore:
    """The frozen environments of one host (``settings.cache_dir / "envs"``)."""

    def __init__(self, settings: Settings) -> None:
        self.root = settings.cache_dir / "envs"

    def _ensure(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PathRefused("the environments dir is not a directory of ours", path=self.root)
        if stat.S_IMODE(st.st_mode) & 0o077:
            self.root.chmod(0o700)
        return self.root

    def path(self, key: str) -> Path:
        """Where environment ``key`` lives (it may not exist)."""
        return self.root / _check_key(key)

    def tree(self, key: str) -> Path:
        """The frozen files of ``key``: what ``/workspace`` gains."""
        return self.path(key) / "tree"

    def get(self, key: str) -> EnvInfo | None:
        """The environment ``key``, or None if there is none (or it is incomplete)."""
        meta = self.path(key) / "meta.json"
        try:
            data = meta.read_bytes()
        except OSError:
            return None
        try:
            return EnvInfo.model_validate_json(data)
        except ValueError:
            log.warning("unreadable environment record; ignored", key=key)
            return None

    def touch(self, key: str) -> None:
        """Record one more use of ``key`` now (for ``env ls`` and ``env prune``)."""
        info = self.get(key)
        if info is None:
            return
        info.last_used = time.time()
        info.uses += 1
        self._write_meta(self.path(key), info)

    @staticmethod
    def _write_meta(where: Path, info: EnvInfo) -> None:
        tmp = where / f".meta.{secrets.token_hex(4)}"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(where / "meta.json")

    def staging(self) -> Path:
        """A fresh staging dir (``tree/`` inside it) to build an environment in."""
        stage = self._ensure() / f".staging-{secrets.token_hex(8)}"
        stage.mkdir(mode=0o700)
        (stage / "tree").mkdir(mode=0o755)
        return stage

    def freeze(self, stage: Path, info: EnvInfo) -> EnvInfo:
        """Make ``stage`` (from :meth:`staging`) environment ``info.key``; returns what is kept.

        If another task froze the same key first, that one is kept and ``stage`` removed.
        """
        final = self.path(info.key)
        info.files, info.size = tree_size(stage / "tree", strip_setid=True)
        info.created_at = info.last_used = time.time()
        self._write_meta(stage, info)
        try:
            stage.rename(final)
        except OSError:
            shutil.rmtree(stage, ignore_errors=True)
            kept = self.get(info.key)
            if kept is None:
                raise AgentboxError(f"could not store environment {info.key}") from None
            return kept
        log.info("environment frozen", key=info.key, files=info.files, size=info.size)
        return info

    def discard(self, stage: Path) -> None:
        """Remove a staging dir that will not be frozen."""
        if stage.parent == self.root and stage.name.startswith(".staging-"):
            shutil.rmtree(stage, ignore_errors=True)

    def list(self) -> builtins.list[EnvInfo]:
        """Every complete environment, most recently used first."""
        out = []
        for key in self._keys():
            info = self.get(key)
            if info is not None:
                out.append(info)
        return sorted(out, key=lambda i: -i.last_used)

    def _keys(self) -> Iterator[str]:
        try:
            names = sorted(p.name for p in self.root.iterdir())
        except FileNotFoundError:
            return
        for name in names:
            if set(name) <= _KEY_CHARS and 8 <= len(name) <= 64:
                yield name

    def in_use(self, key: str) -> bool:
        """Whether a mounted overlay has ``key`` as its lower layer (a task uses it now)."""
        lower = f"lowerdir={self.tree(key)}"
        try:
            mounts = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return False
        return any(lower in line and " overlay " in line for line in mounts.splitlines())

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Delete environment ``key``; False if there was none. Refused while in use."""
        where = self.path(key)
        if not where.is_dir():
            return False
        if self.in_use(key) and not force:
            raise PathRefused(f"environment {key} is in use by a running task", path=where)
        trash = self.root / f".trash-{secrets.token_hex(8)}"
        where.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("environment removed", key=key)
        return True

    def prune(self, older_than: float, *, dry_run: bool = False) -> builtins.list[EnvInfo]:
        """Remove environments unused for ``older_than`` seconds (and not in use now),
        and any staging left by a task that died; returns what was removed (``dry_run``:
        what would be, removing nothing)."""
        cut = time.time() - older_than
        removed = []
        for info in self.list():
            if info.last_used >= cut or self.in_use(info.key):
                continue
            if dry_run or self.remove(info.key):
                removed.append(info)
        if dry_run:
            return removed
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                if p.name.startswith((".staging-", ".trash-")):
                    with contextlib.suppress(OSError):
                        if p.lstat().st_mtime < cut:
                            shutil.rmtree(p, ignore_errors=True)
        return removed
