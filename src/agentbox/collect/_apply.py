"""``agentbox apply``: bring a published result into the user's work tree, safely.

The result is agent-written content, so every git command here that reads it
runs *sealed* (:func:`~agentbox.collect._git.user_git` with ``sealed=True``):
no system or global config, no attributes file but the tree's own, and every
filter, diff and merge driver emptied. An agent's ``.gitattributes`` naming
``filter=lfs`` and its ``.lfsconfig`` naming a server then make nothing run:
the host's git-lfs never starts, an LFS pointer is checked out as the pointer
file it is (and the output names every file the result marks ``filter=lfs``).

Before anything changes, the paths the result adds, changes or removes are
compared with the work tree's untracked and ignored files: one the result
would overwrite or delete (itself, beneath a directory the result turns into
a file or link, or as a file where the result wants a directory) refuses the
apply with the list, unless ``overwrite_ignored``. git treats ignored files as
expendable; the user's ``.env`` is not.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.collect._git import user_git
from agentbox.errors import CommandError, PolicyRefused, RefusedError


@dataclass
class Applied:
    """What :func:`apply_result` did: ``how`` (fast-forward, cherry-picked, checked out)
    and the paths it wrote as LFS pointer files."""

    how: str
    pointers: list[str] = field(default_factory=list)


def _git(repo: Path, *args: str) -> str:
    try:
        return user_git(repo, *args, sealed=True).stdout
    except CommandError as exc:
        raise RefusedError(f"git {args[0]} failed in {repo}: {exc}") from exc


def _z(text: str) -> list[str]:
    return [p for p in text.split("\0") if p]


def _changed(repo: Path, old: str, new: str) -> list[str]:
    """Every path that differs between commits ``old`` and ``new`` (no renames: both sides)."""
    return _z(_git(repo, "diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                   "--name-only", "-z", old, new, "--"))  # fmt: skip


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _occupied(repo: Path, path: str, below: str) -> bool:
    """Whether ``path`` (beneath the untracked directory ``below``) or a part of it after
    ``below`` exists in the work tree: lstat per component, no link followed."""
    parts = path.split("/")
    start = below.count("/") + 1 if below else 0
    for i in range(start, len(parts)):
        try:
            st = os.lstat(repo.joinpath(*parts[: i + 1]))
        except OSError:
            return False
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            return True  # a file or link where the path needs a directory
    return True


def clobbered(repo: Path, changed: list[str]) -> list[str]:
    """The untracked or ignored paths of ``repo``'s work tree that writing ``changed``
    (paths the result adds, changes or removes) would overwrite or delete."""
    if not changed:
        return []
    others = _z(_git(repo, "ls-files", "-z", "--others", "--directory"))
    paths = set(changed)
    above: dict[str, list[str]] = {}
    for p in changed:
        for a in _ancestors(p):
            above.setdefault(a, []).append(p)
    hits: list[str] = []
    for entry in others:
        is_dir = entry.endswith("/")
        name = entry.rstrip("/")
        if name in paths or any(a in paths for a in _ancestors(name)):
            hits.append(entry)  # the result writes it, or turns a directory above it into a file
        elif name in above:
            if not is_dir:
                hits.append(entry)  # a file where the result needs a directory
            else:
                hits += [p for p in above[name] if _occupied(repo, p, name)]
    return sorted(set(hits))


def lfs_pointers(repo: Path, old: str, new: str, paths: list[str]) -> list[str]:
    """Which paths commit ``new`` writes (added or changed since ``old``) that the tree's
    attributes give ``filter=lfs``: written as stored (the LFS pointer), git-lfs not run.

    Two git processes whatever the count (a hostile result may hold 200,000 files):
    the written paths, then ``check-attr --stdin`` on them, sealed like the apply.
    """
    if not paths:
        return []
    written = _z(_git(repo, "diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                      "--name-only", "-z", "--diff-filter=AMT", old, new, "--"))  # fmt: skip
    if not written:
        return []
    try:
        out = user_git(repo, "check-attr", "-z", "--stdin", "filter", sealed=True,
                       input="\0".join(written) + "\0").stdout  # fmt: skip
    except CommandError:
        return []
    fields = out.split("\0")
    return [fields[k] for k in range(0, len(fields) - 2, 3) if fields[k + 2] == "lfs"]


def _check_clobber(repo: Path, changed: list[str], overwrite_ignored: bool) -> None:
    if overwrite_ignored:
        return
    hits = clobbered(repo, changed)
    if hits:
        shown = ", ".join(hits[:20]) + (f" … ({len(hits)} in all)" if len(hits) > 20 else "")
        raise PolicyRefused(
            f"the result would overwrite or delete untracked or ignored files in {repo}: "
            f"{shown}; nothing was changed (move them away, or pass --overwrite-ignored)"
        )


def apply_result(
    repo: Path,
    *,
    task_id: str,
    branch: str,
    commit: str,
    checkout: bool = False,
    overwrite_ignored: bool = False,
) -> Applied:
    """Check ``branch`` out (``checkout``), or bring ``commit`` onto HEAD: a fast-forward
    when HEAD is its ancestor, else a cherry-pick of the task's commits (a conflict is
    aborted and refused). The work tree's clean state is the caller's check; this one
    refuses (nothing changed) when untracked or ignored files would be lost."""
    head = _git(repo, "rev-parse", "--verify", "HEAD^{commit}").strip()
    if checkout:
        changed = _changed(repo, head, commit)
        _check_clobber(repo, changed, overwrite_ignored)
        _git(repo, "checkout", "--quiet", branch, "--")
        return Applied("checked out", lfs_pointers(repo, head, commit, changed))
    ff = user_git(repo, "merge-base", "--is-ancestor", "HEAD", commit, check=False, sealed=True)
    if ff.returncode == 0:
        changed = _changed(repo, head, commit)
        _check_clobber(repo, changed, overwrite_ignored)
        _git(repo, "merge", "--ff-only", "--quiet", commit)
        return Applied("fast-forward", lfs_pointers(repo, head, commit, changed))
    base = _git(repo, "merge-base", "HEAD", commit).strip()
    changed = _changed(repo, base, commit)
    _check_clobber(repo, changed, overwrite_ignored)
    picked = user_git(
        repo, "-c", "user.name=agentbox", "-c", "user.email=agentbox@localhost",
        "cherry-pick", "--allow-empty", f"{base}..{commit}", check=False, sealed=True,
    )  # fmt: skip
    if picked.returncode == 0:
        return Applied("cherry-picked", lfs_pointers(repo, head, "HEAD", changed))
    conflicts = user_git(repo, "diff", "--name-only", "--diff-filter=U", check=False, sealed=True)
    user_git(repo, "cherry-pick", "--abort", check=False, sealed=True)
    names = ", ".join(conflicts.stdout.split()[:10]) or "see git"
    cur = user_git(repo, "rev-parse", "--abbrev-ref", "HEAD", check=False).stdout.strip() or "HEAD"
    raise RefusedError(
        f"task {task_id}'s changes conflict with {cur} in {repo} ({names}); nothing "
        f"was changed. Check out {branch} instead (agentbox apply {task_id} --checkout)"
    )
