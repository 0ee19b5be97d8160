"""Handing the result to the user: fetch the branch from the shadow dir into their repo."""

from __future__ import annotations

import re
from pathlib import Path

from agentbox.collect._collect import branch_name
from agentbox.collect._git import ShadowGit, user_git
from agentbox.errors import CollectError, CommandError

__all__ = ["publish"]

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def publish(shadow_git: Path, repo: Path, *, task_id: str, commit: str) -> str:
    """Fetch ``agentbox/<task-id>`` from the shadow dir into ``repo``; return the branch name.

    Only the ref and its objects change in ``repo``: the fetch runs with hooks
    and fsmonitor off, writes no ``FETCH_HEAD``, runs no auto-gc, and never
    touches the working tree, the index or HEAD (git refuses to update a branch
    that is checked out, which surfaces here as CollectError). ``commit`` must
    be what the shadow branch points at, so a shadow dir changed since
    collection is caught rather than published; the exact commit is fetched.
    """
    branch = branch_name(task_id)
    if not _HEX.fullmatch(commit):
        raise CollectError(f"not a commit id: {commit!r:.80}")
    repo = Path(repo).resolve()
    shadow_git = Path(shadow_git).absolute()
    ref = f"refs/heads/{branch}"
    with ShadowGit(shadow_git) as shadow:
        res = shadow.run("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if res.stdout.strip() != commit:
        raise CollectError(f"{branch} in the shadow dir is {res.stdout.strip()!r}, not {commit}")
    try:
        user_git(
            repo, "-c", f"safe.directory={shadow_git}", "fetch", "--quiet", "--no-tags",
            "--no-write-fetch-head", "--no-auto-gc", "--no-recurse-submodules",
            str(shadow_git), f"+{commit}:{ref}",
        )  # fmt: skip
        got = user_git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").stdout
    except CommandError as exc:
        raise CollectError(f"publishing {branch} into {repo} failed: {exc}") from exc
    if got.strip() != commit:
        raise CollectError(f"{branch} in {repo} is {got.strip()}, expected {commit}")
    return branch
