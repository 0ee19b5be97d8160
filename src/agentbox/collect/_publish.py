"""Handing the result to the user: fetch the branch from the shadow dir into their repo."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from agentbox.collect._collect import branch_name
from agentbox.collect._git import ShadowGit, as_owner, owner_tempdir, repo_owner, user_git
from agentbox.errors import CollectError, CommandError

__all__ = ["publish"]

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def publish(shadow_git: Path, repo: Path, *, task_id: str, commit: str) -> str:
    """Fetch ``agentbox/<task-id>`` from the shadow dir into ``repo``; return the branch name.

    Only the ref and its objects change in ``repo``. The shadow dir writes a
    bundle of the result (everything after the user's commit it was made
    from); git fetches it into ``repo`` **as the repo's owner** (so new
    objects are theirs and their config runs nothing as root), with hooks and
    fsmonitor off, no ``FETCH_HEAD``, no auto-gc, and never touching the work
    tree, the index or HEAD (git refuses to update a branch that is checked
    out: CollectError). ``commit`` must be what the shadow branch points at,
    so a shadow dir changed since collection is caught, not published.
    """
    branch = branch_name(task_id)
    if not _HEX.fullmatch(commit):
        raise CollectError(f"not a commit id: {commit!r:.80}")
    repo = Path(repo).resolve()
    ref = f"refs/heads/{branch}"
    tmp = owner_tempdir(repo)
    try:
        bundle = tmp / "result.bundle"
        with ShadowGit(Path(shadow_git).absolute()) as shadow:
            res = shadow.run("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
            if res.stdout.strip() != commit:
                raise CollectError(
                    f"{branch} in the shadow dir is {res.stdout.strip()!r}, not {commit}"
                )
            shadow.run("bundle", "create", "--quiet", bundle, ref, "^refs/agentbox/head")
        if as_owner(repo):
            os.chown(bundle, *repo_owner(repo))
        try:
            user_git(
                repo, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--no-auto-gc",
                "--no-recurse-submodules", bundle, f"+{ref}:{ref}",
            )  # fmt: skip
            got = user_git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").stdout
        except CommandError as exc:
            raise CollectError(f"publishing {branch} into {repo} failed: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if got.strip() != commit:
        raise CollectError(f"{branch} in {repo} is {got.strip()}, expected {commit}")
    return branch
