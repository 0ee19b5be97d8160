"""What the base looked like at the trusted moment, saved beside the base index.

Two sidecars of ``base_index``, both written by us before the agent ran:

* ``<base_index>.tree``: the base entries grouped by directory, ``{prefix:
  (names joined by NUL, one mode code byte per name)}``. It loads in about a
  millisecond (a few thousand strings, not 50,000 tuples), and each visited
  directory's names become a dict in C.
* ``<base_index>.stat``: ``{path: packed (git mode, st_mode, size, mtime_ns,
  ctime_ns, ino)}``, read only when ``git diff-files`` could not answer and we
  fall back to comparing every entry's lstat ourselves.

A file is unchanged when its lstat matches in type, executable bit, size,
mtime, ctime and inode; ctime cannot be set from userspace, so an agent cannot
forge "unchanged" for a file it rewrote.
"""

from __future__ import annotations

import marshal
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.errors import CollectError
from agentbox.safepath import Tree

__all__ = ["MODES", "BaseListing", "load_keys", "save", "snapshot", "stat_key"]

#: Mode codes of the ``.tree`` sidecar.
MODES = (0o100644, 0o100755, 0o120000, 0o160000)
_CODE = {m: i for i, m in enumerate(MODES)}
_KEY = struct.Struct("<6q")
_VERSION = 2


def stat_key(git_mode: int, st: os.stat_result) -> bytes:
    """The packed tuple compared to decide whether an entry is unchanged."""
    return _KEY.pack(git_mode, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def snapshot(workspace: Path) -> dict[str, os.stat_result]:
    """``lstat`` of every entry in the workspace but its ``.git`` (directories excluded)."""
    out: dict[str, os.stat_result] = {}
    with Tree(workspace) as tree:
        for prefix, entries in tree.scan(lambda rel: rel != ".git"):
            for name, st in entries:
                if not stat.S_ISDIR(st.st_mode):
                    out[prefix + name] = st
    return out


def _paths(base_index: Path) -> tuple[Path, Path]:
    return (
        base_index.with_name(base_index.name + ".tree"),
        base_index.with_name(base_index.name + ".stat"),
    )


def _dump(path: Path, obj: dict[str, bytes] | dict[str, tuple[str, bytes]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        marshal.dump((_VERSION, obj), f)
    tmp.rename(path)


def _load(path: Path) -> object:
    try:
        with open(path, "rb") as f:
            version, obj = marshal.load(f)  # noqa: S302  (our own file, not the agent's)
    except (OSError, ValueError, EOFError, TypeError) as exc:
        raise CollectError(f"cannot read the base sidecar {path}: {exc}") from exc
    if version != _VERSION:
        raise CollectError(f"base sidecar {path} has an unknown format")
    return obj


def save(base_index: Path, modes: dict[str, int], stats: dict[str, os.stat_result]) -> None:
    """Write both sidecars of ``base_index`` (``modes``: every base path -> git mode)."""
    grouped: dict[str, tuple[list[str], bytearray]] = {}
    for rel, mode in modes.items():
        prefix, _, name = rel.rpartition("/")
        names, codes = grouped.setdefault(prefix + "/" if prefix else "", ([], bytearray()))
        names.append(name)
        codes.append(_CODE[mode])
    tree_file, stat_file = _paths(base_index)
    _dump(tree_file, {p: ("\0".join(n), bytes(c)) for p, (n, c) in grouped.items()})
    _dump(stat_file, {r: stat_key(m, stats[r]) for r, m in modes.items() if r in stats})


def load_keys(base_index: Path) -> dict[str, bytes]:
    """The saved stat keys (only needed when git cannot tell what changed)."""
    keys = _load(_paths(base_index)[1])
    if not isinstance(keys, dict):
        raise CollectError("base stat sidecar is malformed")
    return keys


def remove(base_index: Path) -> None:
    """Delete both sidecars if present."""
    for p in _paths(base_index):
        p.unlink(missing_ok=True)


@dataclass
class BaseListing:
    """The base entries by directory: ``known(prefix)`` -> ``{name: git mode}``."""

    dirs: dict[str, tuple[str, bytes]]
    _cache: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def load(cls, base_index: Path) -> BaseListing:
        """Read ``<base_index>.tree``."""
        dirs = _load(_paths(base_index)[0])
        if not isinstance(dirs, dict):
            raise CollectError("base tree sidecar is malformed")
        return cls(dirs)

    def known(self, prefix: str) -> dict[str, int]:
        """The base entries directly in directory ``prefix`` ("" or "a/b/")."""
        got = self._cache.get(prefix)
        if got is None:
            raw = self.dirs.get(prefix)
            got = {} if raw is None else dict(zip(raw[0].split("\0"), raw[1], strict=True))
            self._cache[prefix] = got
        return got

    def mode(self, rel: str) -> int | None:
        """The git mode of base path ``rel``, or None."""
        prefix, _, name = rel.rpartition("/")
        code = self.known(prefix + "/" if prefix else "").get(name)
        return None if code is None else MODES[code]

    def paths_under(self, prefix: str) -> list[str]:
        """Every base path in directory ``prefix`` and below."""
        return [
            p + name
            for p, (names, _) in self.dirs.items()
            if p.startswith(prefix)
            for name in names.split("\0")
        ]
