"""Building the result tree and commit ourselves, from the base tree and the changes.

The index route (``update-index --index-info`` + ``write-tree``) reads and
writes a 50,000-entry index twice; instead we fetch only the base trees of the
directories that changed (one ``git cat-file --batch``), edit them, and write
the new tree objects, the commit object and the branch ref into the shadow dir
ourselves. Object formats are git's own (``tree``: ``<mode> <name>\\0<raw id>``
entries sorted with directories compared as ``name/``). When a changed
directory's path has a character ``cat-file --batch``'s line protocol cannot
carry (a newline in a base directory name), the caller falls back to the
index route.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from agentbox.collect._git import ShadowGit
from agentbox.collect._objects import BlobWriter
from agentbox.errors import CollectError

_TREE = 0o40000


def _parents(path: bytes) -> list[bytes]:
    """Every ancestor directory of ``path``: b"a/b/c" -> [b"a/b", b"a", b""]."""
    out = []
    while b"/" in path:
        path = path.rpartition(b"/")[0]
        out.append(path)
    out.append(b"")
    return out


def _parse_tree(data: bytes, hlen: int) -> dict[bytes, tuple[int, bytes]]:
    entries: dict[bytes, tuple[int, bytes]] = {}
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        nul = data.index(b"\0", sp)
        entries[data[sp + 1 : nul]] = (int(data[pos:sp], 8), data[nul + 1 : nul + 1 + hlen])
        pos = nul + 1 + hlen
    return entries


def _serialise(entries: dict[bytes, tuple[int, bytes]]) -> bytes:
    def key(item: tuple[bytes, tuple[int, bytes]]) -> bytes:
        return item[0] + b"/" if item[1][0] == _TREE else item[0]

    return b"".join(b"%o %s\0%s" % (mode, name, oid) for name, (mode, oid) in sorted(
        entries.items(), key=key))  # fmt: skip


def _base_trees(shadow: ShadowGit, tree: str, dirs: list[bytes], hlen: int
                ) -> dict[bytes, dict[bytes, tuple[int, bytes]]]:  # fmt: skip
    """The base tree of each directory in ``dirs`` ({} where the base has none)."""
    spec = b"".join(
        (tree.encode() + (b":" + d if d else b"") + b"\n") for d in dirs
    )  # fmt: skip
    rc, out = shadow.run_bytes("cat-file", "--batch", input=spec)
    if rc != 0:
        raise CollectError("git cat-file --batch failed in the shadow dir")
    found: dict[bytes, dict[bytes, tuple[int, bytes]]] = {}
    pos = 0
    for d in dirs:
        nl = out.index(b"\n", pos)
        header = out[pos:nl].split(b" ")
        pos = nl + 1
        if header[-1] == b"missing":
            found[d] = {}
            continue
        size = int(header[2])
        body = out[pos : pos + size]
        pos += size + 1
        found[d] = _parse_tree(body, hlen) if header[1] == b"tree" else {}
    return found


Trees = dict[bytes, dict[bytes, tuple[int, bytes]]]


def prefetch(
    shadow: ShadowGit,
    base_tree: str,
    paths: list[bytes],
    object_format: str,
    have: Trees | None = None,
) -> Trees:
    """The base trees of every directory above ``paths`` not in ``have`` (one ``cat-file``).

    Raises ValueError for a directory name the line protocol cannot carry.
    """
    affected: set[bytes] = set()
    for path in paths:
        affected.update(_parents(path))
    if have:
        affected -= have.keys()
    if any(b"\n" in d for d in affected):
        raise ValueError("a directory name cat-file --batch cannot carry")
    if not affected:
        return {}
    return _base_trees(shadow, base_tree, sorted(affected),
                       32 if object_format == "sha256" else 20)  # fmt: skip


def build_tree(
    shadow: ShadowGit,
    objects: BlobWriter,
    base_tree: str,
    updates: dict[bytes, tuple[int, str]],
    deletions: list[bytes],
    trees: Trees | None = None,
) -> str:
    """The id of ``base_tree`` with ``updates`` ({path: (mode, blob id)}) and ``deletions``.

    ``trees`` may hold base trees fetched beforehand (:func:`prefetch`); the
    missing ones are fetched here. Raises ValueError where only the index
    route can go.
    """
    affected: set[bytes] = set()
    for path in [*updates, *deletions]:
        affected.update(_parents(path))
    if not affected:
        return base_tree
    trees = dict(trees or {})
    missing = [d for d in affected if d not in trees]
    if missing:
        trees.update(prefetch(shadow, base_tree, [d + b"/x" if d else b"x" for d in missing],
                              objects.object_format))  # fmt: skip
    dirs = sorted(affected, key=lambda d: (-d.count(b"/") - (1 if d else 0), d))
    removed: dict[bytes, list[bytes]] = defaultdict(list)
    added: dict[bytes, list[tuple[bytes, int, bytes]]] = defaultdict(list)
    for path in deletions:
        parent, _, name = path.rpartition(b"/")
        removed[parent].append(name)
    for path, (mode, hexid) in updates.items():
        parent, _, name = path.rpartition(b"/")
        added[parent].append((name, mode, bytes.fromhex(hexid)))
    results: dict[bytes, bytes | None] = {}
    subdirs: dict[bytes, list[bytes]] = defaultdict(list)
    for d in dirs:
        if d:
            subdirs[d.rpartition(b"/")[0]].append(d)
    for d in dirs:  # deepest first: a directory's children are done before it
        entries = dict(trees[d])
        for name in removed.get(d, ()):
            entries.pop(name, None)
        for sub in subdirs.get(d, ()):
            name = sub.rpartition(b"/")[2]
            sub_id = results[sub]
            if sub_id is None:
                if entries.get(name, (0, b""))[0] == _TREE:
                    entries.pop(name)
            else:
                entries[name] = (_TREE, sub_id)
        for name, mode, raw in added.get(d, ()):
            entries[name] = (mode, raw)
        if not entries and d:
            results[d] = None  # git keeps no empty directory
            continue
        results[d] = bytes.fromhex(objects.write(_serialise(entries), kind="tree"))
    root = results[b""]
    assert root is not None  # the root is written even when empty
    return root.hex()


def write_commit(
    objects: BlobWriter, tree: str, parent: str | None, message: str, *, when: int | None = None
) -> str:
    """Store a commit of ``tree`` on ``parent`` (None: a root commit) by agentbox."""
    stamp = f"{int(time.time()) if when is None else when} +0000"
    who = f"agentbox <agentbox@localhost> {stamp}"
    parents = f"parent {parent}\n" if parent else ""
    body = f"tree {tree}\n{parents}author {who}\ncommitter {who}\n\n{message}"
    return objects.write(body.encode(), kind="commit")


def write_ref(git_dir: Path, ref: str, oid: str) -> None:
    """Point loose ref ``ref`` (``refs/heads/…``, validated by the caller) at ``oid``."""
    path = git_dir / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".lock")
    tmp.write_text(oid + "\n")
    tmp.replace(path)
