"""Helpers shared by the collection tests (no tests here): real git, real files."""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentbox.collect import Base, prepare

GIT_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "User",
    "GIT_AUTHOR_EMAIL": "user@example.com",
    "GIT_COMMITTER_NAME": "User",
    "GIT_COMMITTER_EMAIL": "user@example.com",
    "LC_ALL": "C",
    # The tests (root) inspect repos owned by other uids too.
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": "*",
}


def git(cwd: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None,
        check: bool = True) -> str:  # fmt: skip
    """Run git in ``cwd`` as the user (or the simulated agent) would."""
    res = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**GIT_ENV, **(env or {})},
        input=input,
        capture_output=True,
        check=False,
    )
    if check and res.returncode != 0:
        raise AssertionError(f"git {args} failed: {res.stderr.decode(errors='replace')}")
    return res.stdout.decode(errors="surrogateescape")


def make_repo(path: Path, files: dict[str, str | bytes], *, mode_x: tuple[str, ...] = ()) -> Path:
    """A git repo at ``path`` with ``files`` committed on ``main``."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for rel, content in files.items():
        p = path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
    for rel in mode_x:
        (path / rel).chmod(0o755)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "initial")
    return path


def _hash_tree(root: Path, skip: str | None = ".git") -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if skip and rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != skip]
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(Path(dirpath, d))]):
            p = Path(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = p.lstat()
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            else:
                out[rel] = f"{st.st_mode:o}:" + hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def repo_state(repo: Path) -> dict[str, object]:
    """What publishing must not change: HEAD, index, config, hooks, other refs, work tree."""
    gd = repo / ".git"
    refs = git(repo, "for-each-ref", "--format=%(refname) %(objectname)")
    return {
        "HEAD": (gd / "HEAD").read_bytes(),
        "head_commit": git(repo, "rev-parse", "HEAD"),
        "index": hashlib.sha256((gd / "index").read_bytes()).hexdigest()
        if (gd / "index").exists()
        else None,
        "config": (gd / "config").read_bytes(),
        "hooks": sorted(os.listdir(gd / "hooks")) if (gd / "hooks").exists() else [],
        "refs": [r for r in refs.splitlines() if "refs/heads/agentbox/" not in r],
        "worktree": _hash_tree(repo),
        "FETCH_HEAD": (gd / "FETCH_HEAD").exists(),
    }


def all_objects(git_dir: Path) -> bytes:
    """The content of every object in a repository (loose and packed)."""
    res = subprocess.run(
        ["git", f"--git-dir={git_dir}", "cat-file", "--batch-all-objects", "--batch"],
        env=GIT_ENV,
        capture_output=True,
        check=True,
    )
    return res.stdout


@dataclass
class Prepared:
    """One prepared task: the user's repo, the workspace, the shadow dir, the base."""

    repo: Path
    ws: Path
    shadow: Path
    index: Path
    base: Base


def prepare_in(tmp: Path, repo: Path, **kw: object) -> Prepared:
    """prepare() with every task path under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    ws, shadow, index = tmp / "ws", tmp / "shadow.git", tmp / "base.index"
    base = prepare(repo, ws, shadow, index, **kw)  # type: ignore[arg-type]
    return Prepared(repo, ws, shadow, index, base)
