"""The one write the MCP side does: fetch ``agentbox/<id>`` into the user's repo.

The branch comes from the launcher's trusted shadow git dir, never from the
agent's workspace. Hooks are off for the fetch (``core.hooksPath=/dev/null``),
tags are not fetched, and the refspec names exactly ``agentbox/<id>``.

The shadow dir belongs to the launcher (root), so git's ownership check must
be told it is safe. ``-c safe.directory=…`` is not enough: for a local fetch
git clears ``GIT_CONFIG_PARAMETERS`` before it runs ``upload-pack`` in the
other repository, so the setting goes in a throw-away global config file
(``GIT_CONFIG_GLOBAL``) that names only that one shadow dir; system config is
off.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from agentbox import _proc
from agentbox.errors import CommandError, PathRefused, TaskError
from agentbox.paths import validate_task_id

__all__ = ["branch_name", "fetch_branch"]


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


def fetch_branch(repo: Path, shadow_git: Path, task_id: str, commit: str) -> str:
    """Fetch the task's branch from ``shadow_git`` into ``repo``; return the branch name.

    Verifies that the fetched ref points at ``commit`` (what the launcher
    reported), so a swapped shadow dir cannot hand us something else.
    """
    branch = branch_name(task_id)
    if not shadow_git.is_absolute():
        raise PathRefused("shadow git dir must be absolute", path=shadow_git)
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
        f"+{ref}:{ref}",
    ]
    if any(c in str(shadow_git) for c in '\n"\\'):
        raise PathRefused(
            "shadow git dir path has characters git config cannot hold", path=shadow_git
        )
    try:
        with tempfile.TemporaryDirectory(prefix="agentbox-mcp-git-") as tmp:
            cfg = Path(tmp) / "gitconfig"
            cfg.write_text(f'[safe]\n\tdirectory = "{shadow_git}"\n')
            _proc.run(argv, timeout=120, env=_git_env(cfg))
        got = _proc.run(
            ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            timeout=30,
            env=_git_env(),
        ).stdout.strip()
    except CommandError as exc:
        raise TaskError(
            f"could not fetch {branch} into {repo}: {exc.stderr.strip()[-500:] or exc}",
            task_id=task_id,
        ) from exc
    if commit and got != commit:
        raise TaskError(
            f"fetched {branch} points at {got}, the launcher reported {commit}", task_id=task_id
        )
    return branch
