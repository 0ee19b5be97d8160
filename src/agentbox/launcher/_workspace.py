"""Giving the workspace to the sandbox identity, without ever following a link.

The workspace is a fresh copy the launcher made; before the agent runs it must
belong to the host uid the sandbox's uid maps to (``settings.sandbox_host_uid``),
which owns nothing else on the host. The change has ``chown -R -h`` semantics and
is stricter: the walk holds a directory fd at every level, opens each child
with ``O_NOFOLLOW|O_DIRECTORY`` relative to it and changes owners with
``follow_symlinks=False``, so a symlink (even one planted by a repo's history,
pointing at ``/etc``) is re-owned itself and never traversed, and the walk never
leaves the one workspace directory it was given.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from agentbox.core.paths import TaskPaths
from agentbox.errors import PathRefused
from agentbox.launcher._context import TaskLog
from agentbox.linux.acl import grant_search

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _chown_tree(dir_fd: int, uid: int, gid: int) -> int:
    count = 0
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        # Re-owning only what differs keeps the ctime (and so collection's stat
        # cache) of entries that already belong to the sandbox uid.
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.chown(entry.name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
            count += 1
        if entry.is_dir(follow_symlinks=False):
            try:
                child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:  # replaced by a link or vanished since the listing
                raise PathRefused(
                    f"cannot open workspace dir without following links: {exc}", path=entry.path
                ) from exc
            try:
                count += _chown_tree(child, uid, gid)
            finally:
                os.close(child)
    return count


def give_to_sandbox(workspace: Path, uid: int, gid: int | None = None) -> int:
    """Re-own ``workspace`` and everything in it to ``uid:gid``; return the entries changed.

    Entries already owned by ``uid:gid`` are left alone (``prepare`` may have
    re-owned the tree already; this walk is then the check that it did).

    Refuses a workspace that is a link, not a directory, or not owned by this
    process (a workspace the launcher did not make).
    """
    gid = uid if gid is None else gid
    try:
        fd = os.open(workspace, _DIR_FLAGS)
    except OSError as exc:
        raise PathRefused(
            f"workspace is not a directory reachable without links ({exc.strerror})", path=workspace
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid not in (os.geteuid(), uid):
            raise PathRefused(
                f"workspace is owned by uid {st.st_uid}, not by the launcher: not one it made",
                path=workspace,
            )
        count = _chown_tree(fd, uid, gid)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
            count += 1
        return count
    finally:
        os.close(fd)


def check_owner(workspace: Path, uid: int) -> None:
    """Refuse a workspace that is a link, not a directory, or not owned by ``uid``."""
    try:
        st = os.lstat(workspace)
    except OSError as exc:
        raise PathRefused(f"workspace is missing ({exc.strerror})", path=workspace) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise PathRefused("workspace is not a directory (or is a link)", path=workspace)
    if st.st_uid != uid:
        raise PathRefused(f"workspace is owned by uid {st.st_uid}, expected {uid}", path=workspace)


def ensure_private_dir(path: Path, mode: int = 0o700) -> None:
    """Create ``path`` (not through a link) with ``mode``; refuse one that is a link."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PathRefused("expected a directory, found something else (a link?)", path=path)
    path.chmod(mode)


def let_gofer_through(paths: TaskPaths, gofer_uid: int, tlog: TaskLog) -> None:
    """Let gVisor's gofer (the mapped root of the sandbox's uid slot) search the data dir,
    the tasks dir and this task's.

    It opens the workspace and gateway dir (bind-mount sources) as that uid, which is
    neither owner nor group of these private dirs: a named-user ACL entry gives it
    ``--x`` there and nobody else anything (``o+x`` would open them to every user).
    """
    for d in (paths.data_dir, paths.data_dir / "tasks", paths.root):
        try:
            grant_search(d, gofer_uid)
        except OSError as exc:
            # The backend's own check then names the dir and the fix.
            tlog(f"cannot give runsc's gofer (uid {gofer_uid}) search on {d}: {exc}")


def write_token(path: Path) -> str:
    """A fresh one-time task token, written 0600 at ``path`` (made here, never followed)."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token
