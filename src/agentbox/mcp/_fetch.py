"""The one write the MCP side does: fetch ``agentbox/<id>`` into the user's repo.

The branch comes from the launcher's trusted shadow git dir, never from the
agent's workspace. Hooks are off for the fetch (``core.hooksPath=/dev/null``),
tags are not fetched, and the refspec names exactly ``agentbox/<id>``.

Like the launcher's own publishing (:func:`agentbox.collect.publish`), it never
overwrites a ref it did not write: only the objects are fetched, then the
branch is created compare-and-swap (``update-ref REF COMMIT ""``: it must not
exist). A branch already at the result is left as is; one at any other commit
(the user's own work on ``agentbox/<id>``), a symbolic ref, or a branch checked
out is refused (:class:`~agentbox.errors.PublishRefused`) and left alone.

The shadow dir belongs to the launcher (root), so git's ownership check must
be told it is safe. ``-c safe.directory=…`` is not enough: for a local fetch
git clears ``GIT_CONFIG_PARAMETERS`` before it runs ``upload-pack`` in the
other repository, so the setting goes in a throw-away global config file
(``GIT_CONFIG_GLOBAL``) that names only that one shadow dir; system config is
off.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from agentbox.core import proc as _proc
from agentbox.core.paths import validate_task_id
from agentbox.errors import CommandError, PathRefused, PublishRefused, TaskError


def branch_name(task_id: str) -> str:
    """The result branch of a task: ``agentbox/<id>``."""
    return f"agentbox/{validate_task_id(task_id)}"


def _git_env(global_config: Path | None = None) -> dict[str, str]:
    # No system config and no user global config: only the repo's own config and ours.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": str(global_config) if global_config else "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "LC_ALL": "C",
    }
    return env


def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    argv = ["git", "-C", str(repo), "-c", "core.hooksPath=/dev/null",
            "-c", "core.fsmonitor=false", *args]  # fmt: skip
    return _proc.run(argv, timeout=120, env=env or _git_env()).stdout


def _check_free(repo: Path, ref: str, commit: str) -> bool:
    """True if ``ref`` is already at ``commit``; PublishRefused if it is anyone else's."""
    branch = ref.removeprefix("refs/heads/")
    current = ""
    for line in _git(repo, "for-each-ref", "--format=%(refname)%00%(objectname)%00%(symref)",
                     ref).splitlines():  # fmt: skip
        name, _, rest = line.partition("\0")
        oid, _, target = rest.partition("\0")
        if name != ref:
            continue
        if target:
            raise PublishRefused(f"{branch} in {repo} is a symbolic ref (to {target}); left alone")
        current = oid
    if current == commit:
        return True
    if current:
        raise PublishRefused(
            f"{branch} already exists in {repo} at {current[:12]}, a commit agentbox did not "
            f"write: left alone (the result {commit[:12]} is kept in the launcher)"
        )
    for field in _git(repo, "worktree", "list", "--porcelain", "-z").split("\0"):
        if field == f"branch {ref}":
            raise PublishRefused(f"{branch} is checked out in {repo}: left alone")
    return False


def fetch_branch(repo: Path, shadow_git: Path, task_id: str, commit: str) -> str:
    """Fetch the task's branch from ``shadow_git`` into ``repo``; return the branch name.

    Verifies that the fetched ref points at ``commit`` (what the launcher
    reported), so a swapped shadow dir cannot hand us something else. Never
    overwrites a ref agentbox did not write (see the module docstring).
    """
    branch = branch_name(task_id)
    if not shadow_git.is_absolute():
        raise PathRefused("shadow git dir must be absolute", path=shadow_git)
    if not re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", commit):
        raise TaskError(f"not a commit id: {commit!r:.80}", task_id=task_id)
    ref = f"refs/heads/{branch}"
    argv = [
        "git",
        "-C",
        str(repo),
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "core.fsmonitor=false",
        "-c",
        f"safe.directory={shadow_git}",
        "-c",
        "protocol.file.allow=always",
        "fetch",
        "--no-tags",
        "--no-write-fetch-head",
        "--quiet",
        str(shadow_git),
        ref,  # objects only: the ref is written below, compare-and-swap
    ]
    if any(c in str(shadow_git) for c in '\n"\\'):
        raise PathRefused(
            "shadow git dir path has characters git config cannot hold", path=shadow_git
        )
    try:
        if _check_free(repo, ref, commit):
            return branch  # fetched before: nothing to do
        with tempfile.TemporaryDirectory(prefix="agentbox-mcp-git-") as tmp:
            cfg = Path(tmp) / "gitconfig"
            cfg.write_text(f'[safe]\n\tdirectory = "{shadow_git}"\n')
            _proc.run(argv, timeout=120, env=_git_env(cfg))
        # The shadow branch must be the reported commit: a swapped shadow dir is caught.
        fetched = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").strip()
        if fetched != commit:
            raise TaskError(f"the launcher's shadow dir has no commit {commit}", task_id=task_id)
        try:
            _git(repo, "update-ref", "--no-deref", "-m", f"agentbox: task {task_id}", ref,
                 commit, "")  # fmt: skip
        except CommandError as exc:
            raise PublishRefused(
                f"{branch} in {repo} changed while it was being fetched "
                f"({exc.stderr.strip()[-300:]}): left alone"
            ) from exc
        got = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").strip()
    except CommandError as exc:
        raise TaskError(
            f"could not fetch {branch} into {repo}: {exc.stderr.strip()[-500:] or exc}",
            task_id=task_id,
        ) from exc
    if got != commit:
        raise TaskError(
            f"fetched {branch} points at {got}, the launcher reported {commit}", task_id=task_id
        )
    return branch
