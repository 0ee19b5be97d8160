"""Making a workspace at a trusted moment: :func:`prepare`.

The user's repo is opened once (:class:`~agentbox.collect._git.RepoDir`:
``openat2`` beneath the repos root, no symlink followed) and every git command
in it starts in that descriptor; its path is never looked up again, so a
component swapped for a link after the launcher's checks redirects nothing.
It is only read: ``rev-parse``, ``status --no-optional-locks``,
and ``upload-pack`` (run by our ``fetch`` from the shadow side). With
uncommitted changes included, ``git add -A`` runs against a *copy* of the
user's index and writes its objects into the shadow dir
(``GIT_OBJECT_DIRECTORY``), so neither the user's index nor object store change.

The workspace gets exactly the bytes of the base tree, written by us through
:class:`~agentbox.safepath.SafeWriter` from ``git cat-file --batch`` (no smudge
filter, no eol conversion, no ``export-ignore``), and a fresh ``.git`` of its own
(one root commit of the base tree, no hooks) that the agent may wreck:
collection never reads it. Then the workspace is stat-ed and the stat data
saved next to the base index (see :mod:`agentbox.collect._statcache`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from agentbox import _proc
from agentbox._log import get_logger
from agentbox.collect import _statcache
from agentbox.collect._git import (
    RepoDir,
    ShadowGit,
    as_owner,
    owner_tempdir,
    repo_owner,
    user_git,
)
from agentbox.collect._index import fill_stat
from agentbox.collect._model import Base
from agentbox.collect._objects import BlobWriter
from agentbox.errors import CollectError, CommandError, PathRefused, RefusedError
from agentbox.safepath import Kind, SafeWriter, Tree, openat2

__all__ = ["prepare"]

log = get_logger("collect")

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def _refused(message: str, repo: Path | RepoDir) -> RefusedError:
    return RefusedError(f"{message}: {repo.path if isinstance(repo, RepoDir) else repo}")


def _inspect(repo: RepoDir, commit: str) -> tuple[str, str, str]:
    """Return (object format, commit sha, HEAD sha) of the user's repo, or refuse."""
    if not commit or commit.startswith("-") or "\0" in commit:
        raise _refused(f"bad commit name {commit!r:.80}", repo)
    try:
        # git starts in the opened directory: it must be the top of its work tree
        # (no way up to it), asked without naming any path.
        res = user_git(repo, "rev-parse", "--show-cdup", "--show-object-format")
    except CommandError as exc:
        raise _refused("not a git repository", repo) from exc
    lines = res.stdout.splitlines()
    if len(lines) < 2:
        raise _refused("not a git repository with a work tree", repo)
    cdup, fmt = lines[:2]
    if cdup:
        raise _refused(f"not the top level of its repository ({cdup} up)", repo)
    head = user_git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
    if head.returncode != 0:
        raise _refused("the repository has no commits", repo)
    res = user_git(
        repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}",
        check=False,
    )  # fmt: skip
    if res.returncode != 0 or not _HEX.fullmatch(res.stdout.strip()):
        raise _refused(f"no such commit {commit!r:.80}", repo)
    return fmt.strip(), res.stdout.strip(), head.stdout.strip()


def _dirty(repo: RepoDir) -> list[str]:
    """Tracked paths with staged or unstaged changes (untracked files do not count)."""
    out = user_git(
        repo, "status", "--porcelain=v1", "-z", "--untracked-files=no",
        "--ignore-submodules=all", "--no-renames",
    ).stdout  # fmt: skip
    return [rec[3:] for rec in out.split("\0") if rec]


def _fetch_base(shadow: ShadowGit, repo: RepoDir, sha: str) -> None:
    # Shallow (depth 1), so a big history is not copied. The source is "./": the
    # fetch starts in the opened repo directory and upload-pack inherits it as its
    # working directory, so no path of the user's is looked up again.
    # upload-pack runs in the user's repo: as its owner when we are root (the
    # repo's config is theirs), else with safe.directory from a global config
    # of ours (upload-pack does not see -c options).
    owner = as_owner(repo)
    extra: list[str] = []
    env: dict[str, str] = {}
    if owner:
        extra = [f"--upload-pack={shlex.join([*owner, 'git', 'upload-pack'])}"]
    else:
        cfg = Path(shadow.env()["HOME"]) / "safe.gitconfig"
        where = repo.path
        cfg.write_text(f"[safe]\n\tdirectory = {where}\n\tdirectory = {where / '.git'}\n")
        env = {"GIT_CONFIG_GLOBAL": str(cfg)}
    shadow.run(
        "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--depth=1", *extra, "./",
        f"{sha}:refs/agentbox/head", env=env, cwd=Path(repo.cwd),
    )  # fmt: skip


def _snapshot_uncommitted(shadow: ShadowGit, repo: RepoDir, head: str, fmt: str) -> str:
    """A commit (in the shadow dir) of HEAD plus tracked changes and untracked files.

    ``git add -A`` runs as the repo's owner (its clean filters are theirs) into
    a temporary index and object dir of theirs; we then copy the new loose
    objects into the shadow dir, each one decompressed and re-hashed.
    """
    git_path = user_git(repo, "rev-parse", "--path-format=absolute", "--git-path", "objects",
                        "--git-path", "index").stdout.splitlines()  # fmt: skip
    objects, index = Path(git_path[0]), Path(git_path[1])
    tmp = owner_tempdir(repo)
    try:
        tmp_index, tmp_objects = tmp / "index", tmp / "objects"
        tmp_objects.mkdir()  # git refuses an object directory that does not exist
        if as_owner(repo):
            os.chown(tmp_objects, *repo_owner(repo))
        env = {
            "GIT_INDEX_FILE": str(tmp_index),
            "GIT_OBJECT_DIRECTORY": str(tmp_objects),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(objects),
        }
        # The real index (stat data, staged changes), copied by its owner: never read
        # as root, so an index that is a link to a file of someone else's is not copied.
        copied = _proc.run([*as_owner(repo), "cp", "--", str(index), str(tmp_index)],
                           check=False, cwd=repo.cwd, timeout=300)  # fmt: skip
        if copied.returncode != 0:
            user_git(repo, "read-tree", head, env=env)
        user_git(repo, "add", "-A", env=env)
        tree = user_git(repo, "write-tree", env=env).stdout.strip()
        _import_loose(tmp_objects, BlobWriter(shadow.git_dir, fmt))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Objects HEAD's tree shares came with the fetch; the rest were imported.
    shadow.run("cat-file", "-e", f"{tree}^{{tree}}")
    return shadow.run(
        "commit-tree", tree, "-p", head, "-m", "agentbox: uncommitted changes at the start"
    ).stdout.strip()


def _import_loose(objects: Path, writer: BlobWriter) -> None:
    """Copy loose objects written by the repo's owner, verifying each (links never followed)."""
    if not objects.is_dir():
        return
    with Tree(objects) as tree:
        for e in tree.walk():
            if e.kind is not Kind.FILE or e.path.count(b"/") != 1:
                continue
            try:
                raw = zlib.decompress(tree.read(e.path, limit=1 << 34))
            except zlib.error as exc:
                raise CollectError(f"corrupt object {e.path!r} from git add") from exc
            header, _, body = raw.partition(b"\0")
            kind, _, size = header.partition(b" ")
            if kind not in (b"blob", b"tree") or int(size) != len(body):
                raise CollectError(f"unexpected object {e.path!r} from git add")
            oid = writer.write(body, kind.decode())
            if oid != e.path.replace(b"/", b"").decode():
                raise CollectError(f"object {e.path!r} does not hash to its name")


def _tree_entries(shadow: ShadowGit, tree: str) -> list[tuple[int, str, bytes]]:
    rc, out = shadow.run_bytes("ls-tree", "-r", "-z", "--full-tree", tree)
    if rc != 0:
        raise CollectError(f"git ls-tree {tree} failed in the shadow dir")
    entries = []
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, _, path = rec.partition(b"\t")
        mode, _kind, oid = meta.split(b" ")
        entries.append((int(mode, 8), oid.decode(), path))
    return entries


def _write_workspace(shadow: ShadowGit, tree: str, workspace: Path) -> dict[str, int]:
    """Write the base tree's exact bytes; return {path: git mode} of every entry."""
    entries = _tree_entries(shadow, tree)
    modes: dict[str, int] = {}
    blobs = [(m, oid, p) for m, oid, p in entries if m != 0o160000]
    with SafeWriter(workspace, max_file_size=1 << 62, max_total_size=1 << 62) as writer:
        for mode, _oid, path in entries:
            modes[os.fsdecode(path)] = mode
            if mode == 0o160000:  # a submodule: an empty directory, as git checks out
                writer.mkdir(path)
        for (mode, _oid, path), data in zip(blobs, _cat_blobs(shadow, blobs), strict=True):
            if mode == 0o120000:
                writer.symlink(path, data)
            else:
                writer.write_file(path, data, mode=0o755 if mode == 0o100755 else 0o644)
    return modes


def _cat_blobs(shadow: ShadowGit, blobs: list[tuple[int, str, bytes]]) -> Iterator[bytes]:
    """The content of each blob, in order, from one ``git cat-file --batch``."""
    # Not streamed into memory whole: batches of objects keep memory bounded.
    batch: list[str] = []
    size = 0
    for _mode, oid, _path in blobs:
        batch.append(oid)
        size += 1
        if size >= 2000:
            yield from _cat_batch(shadow, batch)
            batch, size = [], 0
    if batch:
        yield from _cat_batch(shadow, batch)


def _cat_batch(shadow: ShadowGit, oids: list[str]) -> Iterator[bytes]:
    chunks: list[bytes] = []
    with tempfile.TemporaryFile() as stdin:
        stdin.write(("\n".join(oids) + "\n").encode())
        stdin.seek(0)
        err: list[bytes] = []
        rc = _proc.stream(
            shadow.argv(["cat-file", "--batch"]),
            on_stdout=chunks.append,
            on_stderr=err.append,
            env=shadow.env(),
            cwd=shadow.git_dir,
            stdin=stdin.fileno(),
            timeout=shadow.timeout,
        )
    if rc != 0:
        raise CommandError(shadow.argv(["cat-file", "--batch"]), rc, b"".join(err).decode())
    buf = b"".join(chunks)
    pos = 0
    for oid in oids:
        nl = buf.index(b"\n", pos)
        header = buf[pos:nl].split(b" ")
        if len(header) != 3 or header[0].decode() != oid:
            raise CollectError(f"unexpected cat-file output for {oid}")
        size = int(header[2])
        yield buf[nl + 1 : nl + 1 + size]
        pos = nl + 1 + size + 1


def _init_agent_git(shadow: ShadowGit, workspace: Path, tree: str, base: str, fmt: str) -> None:
    """Give the workspace a fresh ``.git`` of its own: one root commit of the base tree."""
    root = shadow.run(
        "commit-tree", tree, "-m", f"agentbox: workspace base (from {base[:12]})"
    ).stdout.strip()
    shadow.run("update-ref", "refs/agentbox/workspace", root)
    agent_git = workspace / ".git"
    with ShadowGit(agent_git) as ws:
        ws.run("init", "--quiet", "--template=", "--initial-branch=main", "--bare",
               f"--object-format={fmt}")  # fmt: skip
        ws.run("config", "core.bare", "false")
        ws.run("config", "user.name", "agentbox agent")
        ws.run("config", "user.email", "agent@agentbox.invalid")
        ws.run(
            "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--update-head-ok",
            str(shadow.git_dir), "refs/agentbox/workspace:refs/heads/main",
        )  # fmt: skip
        ws.run("read-tree", "main", index=agent_git / "index")


def prepare(
    repo: Path,
    workspace: Path,
    shadow_git: Path,
    base_index: Path,
    *,
    commit: str = "HEAD",
    include_uncommitted: bool = False,
    owner: tuple[int, int] | None = None,
    root: Path | None = None,
) -> Base:
    """Make ``workspace`` a fresh copy of ``repo`` at ``commit`` and the trusted shadow dir.

    Refuses (:class:`~agentbox.errors.RefusedError`, nothing written) a path
    that is not the top of a git repository, a repo without commits, a commit
    that does not exist, tracked uncommitted changes when
    ``include_uncommitted`` is off, ``include_uncommitted`` with a commit other
    than HEAD, and a ``workspace``/``shadow_git``/``base_index`` that already exists.
    With ``include_uncommitted``, tracked modifications and untracked files
    that are not ignored are part of the base (a commit of ours on top of HEAD).

    ``owner=(uid, gid)`` chowns the workspace (never following a link) *before*
    its stat data is saved; a chown after ``prepare`` changes every file's ctime
    and makes the next collection re-read every file (still correct, only slower).

    ``repo`` is opened once and used through that descriptor only. With
    ``root`` (the repos root), ``repo`` must be a resolved path beneath it and
    is opened with no symlink followed on the way (:class:`~agentbox.errors.PathRefused`
    otherwise); without it, ``repo`` is resolved first (the caller trusts the path).
    """
    workspace, shadow_git, base_index = (
        Path(p).absolute() for p in (workspace, shadow_git, base_index)
    )
    with RepoDir.open(Path(repo).resolve() if root is None else Path(repo), root=root) as rd:
        return _prepare(rd, workspace, shadow_git, base_index, commit=commit,
                        include_uncommitted=include_uncommitted, owner=owner)  # fmt: skip


def _prepare(
    repo: RepoDir,
    workspace: Path,
    shadow_git: Path,
    base_index: Path,
    *,
    commit: str,
    include_uncommitted: bool,
    owner: tuple[int, int] | None,
) -> Base:
    fmt, sha, head = _inspect(repo, commit)
    if include_uncommitted and sha != head:
        raise _refused("include_uncommitted works only with the HEAD commit", repo)
    if not include_uncommitted:
        dirty = _dirty(repo)
        if dirty and sha == head:
            shown = ", ".join(dirty[:5]) + (" …" if len(dirty) > 5 else "")
            raise _refused(f"uncommitted changes ({shown}); commit them or include them", repo)
    for path, what in ((workspace, "workspace"), (shadow_git, "shadow git dir"),
                       (base_index, "base index")):  # fmt: skip
        if path.exists() or path.is_symlink():
            raise PathRefused(f"{what} already exists", path=path)
    made: list[Path] = []
    try:
        with ShadowGit(shadow_git) as shadow:
            made.append(shadow_git)
            shadow.run("init", "--quiet", "--bare", "--template=", f"--object-format={fmt}")
            _fetch_base(shadow, repo, sha)
            base_commit = (
                _snapshot_uncommitted(shadow, repo, head, fmt) if include_uncommitted else sha
            )
            shadow.run("update-ref", "refs/agentbox/base", base_commit)
            tree = shadow.run("rev-parse", f"{base_commit}^{{tree}}").stdout.strip()
            made.append(workspace)
            workspace.mkdir(mode=0o755)
            modes = _write_workspace(shadow, tree, workspace)
            _init_agent_git(shadow, workspace, tree, base_commit, fmt)
            if owner is not None:
                _chown_tree(workspace, *owner)
            made.append(base_index)
            tmp_index = base_index.with_name(base_index.name + ".tmp")
            stats = _statcache.snapshot(workspace)
            # The index must be younger (in whole seconds) than every file it
            # describes, or git treats entries as racily clean and reads them.
            every = [*stats.files.values(), *stats.dirs.values()]
            _past_second(max((max(st.st_ctime_ns, st.st_mtime_ns) for st in every), default=0))
            shadow.run("read-tree", tree, index=tmp_index)
            fill_stat(
                tmp_index,
                {
                    os.fsencode(r): stats.files[r]
                    for r, m in modes.items()
                    if m != 0o160000 and r in stats.files
                },
                fmt,
            )
            _statcache.save(base_index, modes, stats)
            tmp_index.rename(base_index)
    except BaseException:
        for path in made:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        _statcache.remove(base_index)
        raise
    log.info("prepared", repo=str(repo.path), base=base_commit, tree=tree)
    return Base(
        base_commit=base_commit,
        tree=tree,
        head_commit=head,
        object_format=fmt,
        include_uncommitted=include_uncommitted,
    )


def _past_second(ctime_ns: int) -> None:
    """Return only once the clock is in a later second than ``ctime_ns``.

    git compares stat times in whole seconds unless built with USE_NSEC: an
    agent's write in the same second as our snapshot, keeping size and mtime,
    could look unchanged to it, and entries as old as the index are "racily
    clean" (git re-reads them). After this, both are impossible.
    """
    while time.time_ns() // 1_000_000_000 <= ctime_ns // 1_000_000_000:
        time.sleep(0.05)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """``chown -R -h`` beneath ``root``: every entry, links themselves, never followed."""
    os.chown(root, uid, gid, follow_symlinks=False)
    with Tree(root) as tree:
        for entry in tree.walk():
            parent, _, name = entry.path.rpartition(b"/")
            fd = (
                openat2(tree.fd, parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                if parent
                else os.dup(tree.fd)
            )
            try:
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
