"""What a setup did to the repo's own files.

Setup is meant to *add* an environment (``.venv/``, ``node_modules/``): what it
creates is frozen and reused by later tasks, which skip setup. A change to a file
the workspace held before setup ran (a rewritten ``package-lock.json``, a deleted
or patched source file) cannot be reused that way: a cache hit would start the
agent from a different tree than the miss did, and collection would put setup's
edit on the agent's branch as if the agent had made it.

So the decision is: **such a setup fails the task** (no agent starts), and both
the setup report (``tracked_changed``) and the task's error name the files. The
fix is on the user's side: a setup that leaves the repo as it found it
(``npm ci`` instead of ``npm install``; a build output under an ignored
directory).

:func:`fingerprint` is taken before setup (every regular file's SHA-256 and every
link's target; ``.git`` is the repo's, not compared), :func:`changes` after it,
reading only those paths, beneath the workspace, with no link followed.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentbox.env._key import file_digest
from agentbox.errors import PathRefused
from agentbox.safepath import Kind, Tree

#: At most this many changed files are named in a report.
MAX_NAMED = 50


def _digest(tree: Tree, rel: bytes, kind: Kind) -> str:
    if kind is Kind.SYMLINK:
        target: bytes = tree.readlink(rel)
        return "link:" + target.hex()
    if kind is not Kind.FILE:
        return str(kind.value)
    return "file:" + file_digest(tree, rel).hex()


def fingerprint(workspace: Path) -> dict[bytes, str]:
    """Each regular file's and link's digest under ``workspace`` (``.git`` pruned)."""
    out: dict[bytes, str] = {}
    with Tree(workspace) as tree:
        for e in tree.walk(prune=lambda rel: rel == b".git"):
            if e.kind in (Kind.FILE, Kind.SYMLINK):
                out[e.path] = _digest(tree, e.path, e.kind)
    return out


def changes(workspace: Path, before: dict[bytes, str]) -> list[str]:
    """The paths of ``before`` whose content, link target or type setup changed, or
    which it removed, sorted."""
    changed: list[str] = []
    with Tree(workspace) as tree:
        for rel, digest in before.items():
            try:
                now = _digest(tree, rel, tree.lstat(rel).kind)
            except (OSError, PathRefused):
                now = "missing"
            if now != digest:
                changed.append(os.fsdecode(rel))
    return sorted(changed)
