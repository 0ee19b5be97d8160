"""The stat data of the workspace at its trusted moment, saved beside the base index.

Git's own index carries stat data, but parsing 50,000 index entries in Python
costs more than the stats it saves, so the stat data lives in a sidecar
(``<base_index>.stat``, a ``marshal`` of ``{path: (git mode, st_mode, size,
mtime_ns, ctime_ns, ino)}``) written by us at the trusted moment and read back
in a few milliseconds. The git index at ``base_index`` holds the base tree
(with its cache-tree, so ``write-tree`` after a few updates is cheap).

A file is unchanged when its lstat matches the saved one in type, executable
bit, size, mtime, ctime and inode. ctime cannot be set from userspace, so an
agent cannot forge "unchanged" for a file it rewrote; a file rewritten within
the same kernel tick as the snapshot (never the case: the agent starts later)
is the one blind spot, and git has the same one.
"""

from __future__ import annotations

import marshal
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agentbox.errors import CollectError
from agentbox.safepath import Tree

__all__ = ["StatCache", "StatKey", "keys", "snapshot", "stat_key"]

#: (git mode, st_mode, size, mtime_ns, ctime_ns, ino)
StatKey = tuple[int, int, int, int, int, int]
_VERSION = 1


def stat_key(git_mode: int, st: os.stat_result) -> StatKey:
    """The tuple compared to decide whether an entry is unchanged."""
    return (git_mode, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def snapshot(workspace: Path) -> dict[str, os.stat_result]:
    """``lstat`` of every entry in the workspace but its ``.git`` (directories excluded)."""
    out: dict[str, os.stat_result] = {}
    with Tree(workspace) as tree:
        for prefix, entries in tree.scan(lambda rel: rel != ".git"):
            for name, st in entries:
                if not stat.S_ISDIR(st.st_mode):
                    out[prefix + name] = st
    return out


def keys(stats: dict[str, os.stat_result], modes: dict[str, int]) -> dict[str, StatKey]:
    """The saved form: base entries only (``modes``: path -> git mode)."""
    out = {rel: stat_key(mode, stats[rel]) for rel, mode in modes.items() if rel in stats}
    # Submodule entries are directories: recorded with a zero stat, always "kept".
    for rel, mode in modes.items():
        if mode == 0o160000:
            out[rel] = (mode, 0, 0, 0, 0, 0)
    return out


@dataclass(frozen=True)
class StatCache:
    """Saved stat data of the base entries: ``entries[path] = StatKey``."""

    entries: dict[str, StatKey]

    @staticmethod
    def path_for(base_index: Path) -> Path:
        """Where the sidecar of ``base_index`` lives."""
        return base_index.with_name(base_index.name + ".stat")

    def save(self, path: Path) -> None:
        """Write atomically (temp file, then rename)."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            marshal.dump((_VERSION, self.entries), f)
        tmp.rename(path)

    @classmethod
    def load(cls, path: Path) -> StatCache:
        """Read a sidecar written by :meth:`save` (ours, from the trusted moment)."""
        try:
            with open(path, "rb") as f:
                version, entries = marshal.load(f)  # noqa: S302  (our own file, not the agent's)
        except (OSError, ValueError, EOFError, TypeError) as exc:
            raise CollectError(f"cannot read the base stat cache {path}: {exc}") from exc
        if version != _VERSION or not isinstance(entries, dict):
            raise CollectError(f"base stat cache {path} has an unknown format")
        return cls(entries)
