"""Running git on test repos the way a user would, without the host's git config."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: No system or global config, a fixed identity: results do not depend on the host.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "HOME": "/nonexistent",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}


def commit_repo(path: Path, files: dict[str, str] | None = None) -> Path:
    """A new repo at ``path`` (branch ``main``) with ``files`` (default a README) in one
    commit; ``path``."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in (files or {"README.md": "hello\n"}).items():
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def git(repo: Path, *args: str) -> str:
    """``git -C repo args`` (the repo may belong to another uid); its stdout. Raises on failure."""
    return subprocess.run(
        ["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args],
        env={"PATH": os.environ["PATH"], **GIT_ENV},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
