"""Which repos an MCP caller may delegate: only git repos inside the repos root, owned by us.

The path comes from an MCP call, i.e. from a model that may be prompt-injected.
It is refused (``PathRefused``) unless, after resolving every link, it lies
inside ``settings.repos_root``, no component on the way is a symlink that
leaves the root, it is owned by the uid the MCP server runs as (never another
user's tree, so a fetch into it cannot write into someone else's files), and it
is a git work tree (``.git`` a directory we own, not a ``gitdir:`` file
pointing elsewhere).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentbox.config import setting_source
from agentbox.errors import PathRefused

MAX_PATH_CHARS = 4096


def validate_repo(repos_root: Path, repo: object, *, uid: int | None = None) -> Path:
    """Return the resolved repo path for ``repo`` or raise :class:`PathRefused`.

    ``uid`` is the owner the repo must have (default: our effective uid).
    """
    if not isinstance(repo, str) or not repo.strip():
        raise PathRefused("repo must be a non-empty path string", path=repr(repo)[:80])
    if len(repo) > MAX_PATH_CHARS or "\x00" in repo:
        raise PathRefused("repo path is too long or contains NUL", path=repr(repo)[:80])
    raw = Path(repo)
    if not raw.is_absolute():
        raise PathRefused(f"repo must be an absolute path under {repos_root}", path=repo)
    if ".." in raw.parts:
        raise PathRefused("repo path must not contain '..'", path=repo)
    root = repos_root.resolve()
    real = raw.resolve()
    if real != root and root not in real.parents:
        raise PathRefused(
            f"repo resolves outside the repos root {root} "
            f"({setting_source('repos_root', repos_root)})",
            path=repo,
        )
    if real == root:
        raise PathRefused(
            f"repo must be a directory below the repos root, not the root "
            f"({setting_source('repos_root', repos_root)})",
            path=repo,
        )
    # Walk the components as given: a link anywhere on the way is refused even if
    # its target happens to lie inside the root (the target can be swapped later).
    cur = Path(raw.anchor)
    for part in raw.parts[1:]:
        cur = cur / part
        try:
            st = cur.lstat()
        except OSError as exc:
            raise PathRefused(f"repo does not exist ({exc.strerror})", path=repo) from exc
        if stat.S_ISLNK(st.st_mode) and (cur in (raw, root) or root in cur.parents):
            raise PathRefused("repo path goes through a symlink", path=str(cur))
    want = os.geteuid() if uid is None else uid
    st = real.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PathRefused("repo is not a directory", path=repo)
    if st.st_uid != want:
        raise PathRefused(f"repo is owned by uid {st.st_uid}, not by uid {want}", path=repo)
    try:
        gst = (real / ".git").lstat()
    except OSError as exc:
        raise PathRefused("repo is not a git work tree (no .git directory)", path=repo) from exc
    if not stat.S_ISDIR(gst.st_mode):
        raise PathRefused("repo's .git is not a directory (gitdir files are refused)", path=repo)
    if gst.st_uid != want:
        raise PathRefused(f"repo's .git is owned by uid {gst.st_uid}, not by uid {want}", path=repo)
    return real
