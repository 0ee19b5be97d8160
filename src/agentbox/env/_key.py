"""The key of a frozen environment: the image id, the setup commands and the inputs' contents.

The inputs are read from the task's fresh workspace copy (the repo at its base
commit), beneath it with ``openat2`` and no link followed: a repo cannot make
the key read a host file by committing ``requirements.txt -> /etc/shadow``
(such an input is refused by name). Globs match repo-relative paths
(:func:`fnmatch.fnmatchcase`, where ``*`` also matches ``/``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path

from agentbox.boxfile import Setup
from agentbox.errors import PathRefused
from agentbox.safepath import Kind, Tree

__all__ = ["KEY_VERSION", "MAX_INPUT_BYTES", "MAX_INPUT_FILES", "env_key", "match_inputs"]

#: Bumped when what the key covers changes, so old environments are never reused wrongly.
KEY_VERSION = 1
#: One input file may hold at most this much (lock files are well under it).
MAX_INPUT_BYTES = 64 << 20
#: At most this many files may match the inputs' globs.
MAX_INPUT_FILES = 1000
#: Directories never searched for inputs.
_SKIP = (b".git",)


def match_inputs(tree: Tree, globs: tuple[str, ...]) -> list[str]:
    """Repo-relative paths of the regular files ``globs`` match, sorted.

    A match that is a link or special file is refused (:class:`PathRefused`); more than
    :data:`MAX_INPUT_FILES` matches too.
    """
    if not globs:
        return []
    found: list[str] = []
    for entry in tree.walk(prune=lambda rel: rel in _SKIP):
        rel = os.fsdecode(entry.path)
        if not any(fnmatch.fnmatchcase(rel, g) for g in globs):
            continue
        if entry.kind is Kind.DIR:
            continue
        if entry.kind is not Kind.FILE:
            raise PathRefused("a [setup] input must be a regular file, not a link", path=rel)
        found.append(rel)
        if len(found) > MAX_INPUT_FILES:
            raise PathRefused(f"[setup] inputs match more than {MAX_INPUT_FILES} files")
    return sorted(found)


def env_key(image_id: str, setup: Setup, workspace: Path) -> tuple[str, list[str]]:
    """``(key, inputs)``: the hex key of the environment ``setup`` makes on ``image_id``.

    Covers :data:`KEY_VERSION`, the image id, the commands in order, the network
    mode, the ``keep`` paths, and each matched input's path and content. Raises :class:`PathRefused`
    for an input that is a link, too large or unreadable.
    """
    h = hashlib.sha256()
    head = {"v": KEY_VERSION, "image": image_id, "run": list(setup.run), "net": setup.network}
    if setup.keep:
        head["keep"] = list(setup.keep)
    h.update(json.dumps(head, sort_keys=True).encode())
    with Tree(workspace) as tree:
        inputs = match_inputs(tree, setup.inputs)
        for rel in inputs:
            data = tree.read(rel, MAX_INPUT_BYTES)
            h.update(b"\0file\0" + os.fsencode(rel) + b"\0")
            h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:32], inputs
