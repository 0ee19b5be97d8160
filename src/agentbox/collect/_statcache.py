"""What the base looked like at the trusted moment, saved beside the base index.

Two sidecars of ``base_index``, both written by us before the agent ran:

* ``<base_index>.tree``: every directory of the workspace, ``{prefix: (base
  entry names joined by NUL, one mode code byte per name, the directory's
  packed (mtime_ns, ctime_ns, ino, dev), its subdirectory names)}``. It loads
  in about a millisecond (a few thousand strings, not 50,000 tuples).
  A directory whose key is unchanged has the same names as then (creating,
  removing or renaming an entry updates the directory's mtime and ctime, and
  ctime cannot be set back), so collection need not read it again.
* ``<base_index>.stat``: ``{path: packed (git mode, st_mode, size, mtime_ns,
  ctime_ns, ino)}``, read only when ``git diff-files`` could not answer and we
  fall back to comparing every entry's lstat ourselves.
* ``<base_index>.racy``: ``(newest second, {path: packed key})`` for the files
  whose saved ctime is in the newest second of the snapshot. git compares
  whole seconds, so an agent's write in that same second (size and mtime kept)
  could pass it; collection compares these few at full precision itself. With
  it, ``prepare`` need not wait for the next second (it waits a clock tick).

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
from typing import Any

from agentbox.errors import CollectError
from agentbox.safepath import Tree

#: Mode codes of the ``.tree`` sidecar.
MODES = (0o100644, 0o100755, 0o120000, 0o160000)
_CODE = {m: i for i, m in enumerate(MODES)}
_KEY = struct.Struct("<6q")
_DKEY = struct.Struct("<4q")
_VERSION = 3


def stat_key(git_mode: int, st: os.stat_result) -> bytes:
    """The packed tuple compared to decide whether an entry is unchanged."""
    return _KEY.pack(git_mode, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def dir_key(st: os.stat_result) -> bytes:
    """What must not change for a directory's list of names to be unchanged."""
    return _DKEY.pack(st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass
class Snapshot:
    """The workspace at the trusted moment: every non-directory's lstat, every directory's."""

    files: dict[str, os.stat_result] = field(default_factory=dict)
    dirs: dict[str, os.stat_result] = field(default_factory=dict)
    subdirs: dict[str, list[str]] = field(default_factory=dict)


def snapshot(workspace: Path) -> Snapshot:
    """``lstat`` every entry of the workspace but its ``.git``; directories keyed ``"a/b/"``."""
    snap = Snapshot()
    snap.dirs[""] = os.lstat(workspace)
    with Tree(workspace) as tree:
        for prefix, entries in tree.scan(lambda rel: rel != ".git"):
            subs = snap.subdirs.setdefault(prefix, [])
            for name, st in entries:
                if not stat.S_ISDIR(st.st_mode):
                    snap.files[prefix + name] = st
                elif prefix or name != ".git":
                    snap.dirs[prefix + name + "/"] = st
                    subs.append(name)
    return snap


def _paths(base_index: Path) -> tuple[Path, Path, Path]:
    return (
        base_index.with_name(base_index.name + ".tree"),
        base_index.with_name(base_index.name + ".stat"),
        base_index.with_name(base_index.name + ".racy"),
    )


def _dump(path: Path, obj: dict[str, Any] | list[Any]) -> None:
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


def save(base_index: Path, modes: dict[str, int], snap: Snapshot, *, newest: int) -> None:
    """Write the sidecars of ``base_index`` (``modes``: every base path -> git mode).

    ``newest``: the newest ctime or mtime (ns) in the snapshot.
    """
    grouped: dict[str, tuple[list[str], bytearray]] = {p: ([], bytearray()) for p in snap.dirs}
    for rel, mode in modes.items():
        prefix, _, name = rel.rpartition("/")
        names, codes = grouped.setdefault(prefix + "/" if prefix else "", ([], bytearray()))
        names.append(name)
        codes.append(_CODE[mode])
    gitlinks = {rel for rel, mode in modes.items() if mode == 0o160000}
    listing = {
        p: (
            "\0".join(n),
            bytes(c),
            dir_key(snap.dirs[p]) if p in snap.dirs else b"",
            "\0".join(s for s in snap.subdirs.get(p, ()) if p + s not in gitlinks),
        )
        for p, (n, c) in grouped.items()
    }
    tree_file, stat_file, racy_file = _paths(base_index)
    _dump(tree_file, listing)
    keys = {r: stat_key(m, snap.files[r]) for r, m in modes.items() if r in snap.files}
    _dump(stat_file, keys)
    second = newest // 1_000_000_000
    racy = {r: keys[r] for r in keys if snap.files[r].st_ctime_ns // 1_000_000_000 >= second}
    _dump(racy_file, [second, racy])


def load_keys(base_index: Path) -> dict[str, bytes]:
    """The saved stat keys (only needed when git cannot tell what changed)."""
    keys = _load(_paths(base_index)[1])
    if not isinstance(keys, dict):
        raise CollectError("base stat sidecar is malformed")
    return keys


def stat_keys_size(base_index: Path) -> int:
    """The size in bytes of the saved stat keys (OSError when there are none)."""
    return _paths(base_index)[1].stat().st_size


def load_racy(base_index: Path) -> tuple[int, dict[str, bytes]] | None:
    """The newest second and the keys of the files saved in it; None if never saved.

    None for a base made before this sidecar existed (its ``prepare`` waited
    for the next second, so git alone could judge every file).
    """
    path = _paths(base_index)[2]
    if not path.exists():
        return None
    got = _load(path)
    if not (isinstance(got, list) and len(got) == 2 and isinstance(got[0], int)
            and isinstance(got[1], dict)):  # fmt: skip
        raise CollectError("base racy sidecar is malformed")
    return got[0], got[1]


def key_mode(key: bytes) -> int:
    """The git mode a packed :func:`stat_key` was made with."""
    return int(_KEY.unpack(key)[0])


def remove(base_index: Path) -> None:
    """Delete both sidecars if present."""
    for p in _paths(base_index):
        p.unlink(missing_ok=True)


@dataclass
class BaseListing:
    """The base by directory: ``known(prefix)`` -> ``{name: mode code}``, keys, subdirectories.

    ``prefix`` is ``""`` for the root, else ``"a/b/"``.
    """

    dirs: dict[str, tuple[str, bytes, bytes, str]]
    _cache: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def load(cls, base_index: Path) -> BaseListing:
        """Read ``<base_index>.tree``."""
        dirs = _load(_paths(base_index)[0])
        if not isinstance(dirs, dict):
            raise CollectError("base tree sidecar is malformed")
        return cls(dirs)

    def known(self, prefix: str) -> dict[str, int]:
        """The base entries (not directories) directly in ``prefix``: name -> mode code."""
        got = self._cache.get(prefix)
        if got is None:
            raw = self.dirs.get(prefix)
            got = {} if raw is None or not raw[0] else dict(zip(raw[0].split("\0"), raw[1],
                                                                  strict=True))  # fmt: skip
            self._cache[prefix] = got
        return got

    def count(self, prefix: str) -> int:
        """How many base entries are directly in ``prefix`` (without building the dict)."""
        raw = self.dirs.get(prefix)
        return 0 if raw is None else len(raw[1])

    def names(self, prefix: str) -> list[str]:
        """The base entries directly in ``prefix`` (files, links, submodules)."""
        raw = self.dirs.get(prefix)
        return raw[0].split("\0") if raw is not None and raw[0] else []

    def dir_key(self, prefix: str) -> bytes | None:
        """The saved :func:`dir_key` of directory ``prefix``, if it was in the workspace."""
        raw = self.dirs.get(prefix)
        return raw[2] if raw is not None and raw[2] else None

    def subdirs(self, prefix: str) -> list[str]:
        """The names of the directories directly in ``prefix`` at the trusted moment."""
        raw = self.dirs.get(prefix)
        return raw[3].split("\0") if raw is not None and raw[3] else []

    def mode(self, rel: str) -> int | None:
        """The git mode of base path ``rel``, or None."""
        prefix, _, name = rel.rpartition("/")
        code = self.known(prefix + "/" if prefix else "").get(name)
        return None if code is None else MODES[code]
