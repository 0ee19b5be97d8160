"""The key of a frozen environment: everything setup's result can depend on.

A frozen environment is reused only by a task whose setup would have seen the same
things: the image id, the commands, the network mode and the egress
hosts, every variable and mount of the setup's sandbox, the repo's identity, the user
who submitted the task, and the files:

* ``[setup] key = "tree"`` (the default): the whole workspace setup starts from (every
  path, its kind, its executable bit and content, or a link's target; ``.git`` aside),
  so a file setup reads that ``inputs`` does not name (a ``build.sh`` it runs) changes
  the key;
* ``[setup] key = "inputs"``: only the files ``inputs`` matches, a narrowing the user
  opts into (a lock file is all an install reads). A task that continues a previous
  one (``agentbox resume``) keys on the whole tree even so: its workspace is what the
  previous agent left, which the user's hint says nothing about.

The repo's identity is its path's owner and real path (``uid:/real/path``), not its
root commit: two clones or forks of one project are two repos, so one cannot seed
the other. The user is the submitting uid; a host that wants its users to share
environments says so (``AGENTBOX_ENV_SHARED_ACROSS_USERS=1``), never by accident.

The files are read from the task's fresh workspace copy, beneath it with ``openat2``
and no link followed: a repo cannot make the key read a host file by committing
``requirements.txt -> /etc/shadow`` (such an input is refused by name). Globs match
repo-relative paths (:func:`fnmatch.fnmatchcase`, where ``*`` also matches ``/``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.boxfile import Setup
from agentbox.errors import PathRefused
from agentbox.safepath import Kind, Tree

#: Bumped when what the key covers changes, so old environments are never reused wrongly.
KEY_VERSION = 2
#: One input file may hold at most this much (lock files are well under it).
MAX_INPUT_BYTES = 64 << 20
#: At most this many files may match the inputs' globs.
MAX_INPUT_FILES = 1000
#: Directories never searched for inputs.
_SKIP = (b".git",)


@dataclass(frozen=True)
class KeyScope:
    """What the setup's sandbox sees besides the workspace's files (see the module doc).

    ``user`` None: shared across users (the host's setting) or no user known (a direct
    caller). ``resumed``: the workspace is a previous task's result.
    """

    user: int | None = None
    repo: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: Sequence[tuple[str, str, bool]] = ()
    hosts: Sequence[str] = ()
    resumed: bool = False


def repo_identity(repo: Path) -> str:
    """``uid:/real/path`` of ``repo``: its owner and where it really is."""
    real = Path(os.path.realpath(repo))
    try:
        owner = real.stat().st_uid
    except OSError:
        owner = -1
    return f"{owner}:{real}"


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


def file_digest(tree: Tree, rel: bytes) -> bytes:
    """SHA-256 of the file ``rel`` of ``tree``, read through the tree (no link followed)."""
    h = hashlib.sha256()
    fd = tree.open(rel)
    try:
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.digest()


def tree_digest(tree: Tree) -> str:
    """The hex digest of every entry beneath ``tree`` (``.git`` at the top aside): each
    path with its kind, a file's executable bit and content, a link's target. Links are
    never followed; a special file counts by its kind only."""
    entries = sorted(tree.walk(prune=lambda rel: rel in _SKIP), key=lambda e: e.path)
    h = hashlib.sha256()
    for e in entries:
        h.update(b"\0" + e.path + b"\0" + e.kind.name.encode())
        if e.kind is Kind.FILE:
            h.update(b"x" if e.mode & stat.S_IXUSR else b"-")
            h.update(file_digest(tree, e.path))
        elif e.kind is Kind.SYMLINK:
            h.update(tree.readlink(e.path))
    return h.hexdigest()


def env_key(
    image_id: str, setup: Setup, workspace: Path, scope: KeyScope | None = None
) -> tuple[str, list[str]]:
    """``(key, inputs)``: the hex key of the environment ``setup`` makes on ``image_id``.

    Covers :data:`KEY_VERSION`, the image id, the commands in order, the network mode,
    the ``keep`` paths, ``scope`` (user, repo, variables, mounts, egress hosts) and the
    files: the whole workspace (``key = "tree"``, or any resumed task), else each
    matched input's path and content. Raises :class:`PathRefused` for an input that is
    a link, too large or unreadable.
    """
    scope = scope or KeyScope()
    whole = setup.key == "tree" or scope.resumed
    h = hashlib.sha256()
    head = {
        "v": KEY_VERSION,
        "image": image_id,
        "run": list(setup.run),
        "net": setup.network,
        "keep": list(setup.keep),
        "user": scope.user,
        "repo": scope.repo,
        "env": dict(sorted(scope.env.items())),
        "mounts": sorted([list(m) for m in scope.mounts]),
        "hosts": sorted(scope.hosts),
        "files": "tree" if whole else "inputs",
    }
    h.update(json.dumps(head, sort_keys=True).encode())
    with Tree(workspace) as tree:
        inputs = match_inputs(tree, setup.inputs)
        if whole:
            h.update(b"\0tree\0" + tree_digest(tree).encode())
        else:
            for rel in inputs:
                data = tree.read(rel, MAX_INPUT_BYTES)
                h.update(b"\0file\0" + os.fsencode(rel) + b"\0")
                h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:32], inputs
