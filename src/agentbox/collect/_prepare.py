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

The workspace gets exactly the bytes of the base tree (:mod:`._checkout`:
written by us through :class:`~agentbox.safepath.SafeWriter` from ``git
cat-file --batch``, or reflinked from the user's work tree and verified, where
the filesystem can), and a fresh ``.git`` of its own (one root commit of the
base tree, no hooks) that the agent may wreck: collection never reads it. Then
the workspace is stat-ed and the stat data saved next to the base index (see
:mod:`agentbox.collect._statcache`). No whole-second wait: see :func:`_past`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import re
import shlex
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from agentbox.collect import _statcache
from agentbox.collect._basecache import BaseCache, Entry
from agentbox.collect._checkout import chown_tree, init_agent_git, tree_listing, write_workspace
from agentbox.collect._git import (
    RepoDir,
    ShadowGit,
    as_owner,
    init_repo,
    owner_tempdir,
    repo_owner,
    user_git,
)
from agentbox.collect._index import fill_stat
from agentbox.collect._model import Base
from agentbox.collect._objects import BlobWriter
from agentbox.collect._tree import write_ref
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import CollectError, CommandError, PathRefused, RefusedError
from agentbox.safepath import Kind, Tree

log = get_logger(__name__)

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def _refused(message: str, repo: Path | RepoDir) -> RefusedError:
    return RefusedError(f"{message}: {repo.path if isinstance(repo, RepoDir) else repo}")


def _inspect(repo: RepoDir, commit: str) -> tuple[str, str, str]:
    """Return (object format, commit sha, HEAD sha) of the user's repo, or refuse."""
    if not commit or commit.startswith("-") or "\0" in commit:
        raise _refused(f"bad commit name {commit!r:.80}", repo)
    # One git process when all is well (the name cannot start with "-": no option);
    # the step-by-step questions below only to say precisely what is wrong.
    once = user_git(
        repo, "rev-parse", "--show-cdup", "--show-object-format",
        "HEAD^{commit}", f"{commit}^{{commit}}", "--", check=False,
    )  # fmt: skip
    got = once.stdout.split("\n")
    if (
        once.returncode == 0 and len(got) == 6 and got[4:] == ["--", ""] and not got[0]
        and got[1] in ("sha1", "sha256") and _HEX.fullmatch(got[2]) and _HEX.fullmatch(got[3])
    ):  # fmt: skip
        return got[1], got[3], got[2]
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


def _dirty(repo: RepoDir) -> tuple[list[str], list[str]]:
    """Tracked paths with staged or unstaged changes, and the untracked files that are
    not ignored (never copied without ``include_uncommitted``: the report says so)."""
    out = user_git(
        repo, "status", "--porcelain=v1", "-z", "--untracked-files=all",
        "--ignore-submodules=all", "--no-renames",
    ).stdout  # fmt: skip
    recs = [rec for rec in out.split("\0") if rec]
    return [r[3:] for r in recs if not r.startswith("??")], [r[3:] for r in recs if r[:2] == "??"]


def _fetch_base(shadow: ShadowGit, repo: RepoDir, sha: str, *, keep_pack: bool = False) -> None:
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
    # keep_pack: the objects stay one pack (for the base cache), never unpacked loose.
    keep = ["-c", "fetch.unpackLimit=1"] if keep_pack else []
    shadow.run(
        *keep, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--depth=1", *extra, "./",
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
    cache: Path | None = None,
) -> Base:
    """:func:`prepare_unsettled`, then its wait: a workspace any sandbox may write at once."""
    base, settle = prepare_unsettled(
        repo, workspace, shadow_git, base_index, commit=commit,
        include_uncommitted=include_uncommitted, owner=owner, root=root, cache=cache,
    )  # fmt: skip
    settle()
    return base


def prepare_unsettled(
    repo: Path,
    workspace: Path,
    shadow_git: Path,
    base_index: Path,
    *,
    commit: str = "HEAD",
    include_uncommitted: bool = False,
    owner: tuple[int, int] | None = None,
    root: Path | None = None,
    cache: Path | None = None,
) -> tuple[Base, Callable[[], None]]:
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

    ``cache`` (a directory of ours) keeps what git spends on a commit of a repo for the
    next task from it (:mod:`agentbox.collect._basecache`): no fetch from the repo,
    no ``ls-tree``, ``read-tree`` or ``pack-objects`` on a hit.

    Returned with the base: the wait (:func:`_past`) that must end before anything but
    us writes the workspace (a sandbox started on it). A caller with more work of its
    own before that (the launcher: the sandbox's spec, its checks, a pool claim) calls
    it last, and its work is what the wait would have spent (a tick of the timestamp
    clock, ~2-4 ms of every task on the path).
    """
    workspace, shadow_git, base_index = (
        Path(p).absolute() for p in (workspace, shadow_git, base_index)
    )
    with RepoDir.open(Path(repo).resolve() if root is None else Path(repo), root=root) as rd:
        return _prepare(rd, workspace, shadow_git, base_index, commit=commit,
                        include_uncommitted=include_uncommitted, owner=owner,
                        cache=None if cache is None else BaseCache(cache))  # fmt: skip


def _prepare(
    repo: RepoDir,
    workspace: Path,
    shadow_git: Path,
    base_index: Path,
    *,
    commit: str,
    include_uncommitted: bool,
    owner: tuple[int, int] | None,
    cache: BaseCache | None = None,
) -> tuple[Base, Callable[[], None]]:
    # status beside rev-parse (both only read the repo): one git process's wait fewer.
    # Its answer is used only once rev-parse said the repo is what we take it for.
    with concurrent.futures.ThreadPoolExecutor(1) as side:
        status = None if include_uncommitted else side.submit(_dirty, repo)
        fmt, sha, head = _inspect(repo, commit)
        if include_uncommitted and sha != head:
            raise _refused("include_uncommitted works only with the HEAD commit", repo)
        dirty, untracked = ([], []) if status is None else status.result()
    if not include_uncommitted:
        if sha != head:
            untracked = []  # a resumed task starts from a commit: the work tree is not its base
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
            init_repo(shadow_git, fmt)
            entry = _from_cache(cache, repo, fmt, sha, shadow_git)
            if entry is None:
                _fetch_base(shadow, repo, sha, keep_pack=cache is not None)
            base_commit = (
                _snapshot_uncommitted(shadow, repo, head, fmt) if include_uncommitted else sha
            )
            write_ref(shadow_git, "refs/agentbox/base", base_commit)
            if base_commit != sha:
                entry = None  # the cache's tree, listing, index and pack are sha's
            tree = (
                entry.tree if entry is not None
                else shadow.run("rev-parse", f"{base_commit}^{{tree}}").stdout.strip()
            )  # fmt: skip
            listing = entry.listing if entry is not None else tree_listing(shadow, tree)
            made.append(workspace)
            workspace.mkdir(mode=0o755)
            # Not in parallel with the agent's .git: its fetch competes with the writes
            # (30 MiB of blobs: 36 s against 25 s on a loaded 2-core machine).
            done = write_workspace(shadow, tree, workspace, fmt=fmt, source=repo, listing=listing)
            tree_pack = init_agent_git(
                shadow, workspace, tree, base_commit, fmt,
                tree_pack=None if entry is None else entry.copy_agent_pack,
            )  # fmt: skip
            modes = done.modes
            made.append(base_index)
            tmp_index = base_index.with_name(base_index.name + ".tmp")
            if entry is not None:
                shutil.copyfile(entry.index, tmp_index)
            else:
                shadow.run("read-tree", tree, index=tmp_index)
                if cache is not None and base_commit == sha:
                    cache.put(repo, fmt, sha, shadow_git=shadow_git, tree=tree, listing=listing,
                              index=tmp_index, agent_pack=tree_pack)  # fmt: skip
            if owner is not None:
                chown_tree(workspace, *owner)
            stats = _statcache.snapshot(workspace)
            every = [*stats.files.values(), *stats.dirs.values()]
            newest = max((max(st.st_ctime_ns, st.st_mtime_ns) for st in every), default=0)
            fine = any(st.st_ctime_ns % 1_000_000_000 for st in every)
            # The workspace's own index is that read-tree too (before its stat data
            # is filled in, as a read-tree in the workspace's .git would have it).
            agent_index = workspace / ".git" / "index"
            shutil.copyfile(tmp_index, agent_index)
            if owner is not None:
                os.chown(agent_index, *owner, follow_symlinks=False)
            fill_stat(
                tmp_index,
                {
                    os.fsencode(r): stats.files[r]
                    for r, m in modes.items()
                    if m != 0o160000 and r in stats.files
                },
                fmt,
            )
            _statcache.save(base_index, modes, stats, newest=newest)
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
    log.info("prepared", repo=str(repo.path), base=base_commit, tree=tree,
             cloned=done.cloned, written=done.written, cached=entry is not None)  # fmt: skip
    return Base(
        base_commit=base_commit,
        tree=tree,
        head_commit=head,
        object_format=fmt,
        include_uncommitted=include_uncommitted,
        untracked_not_copied=len(untracked),
        untracked_sample=tuple(untracked[:UNTRACKED_SAMPLE]),
    ), functools.partial(_past, newest, fine=fine)


def _from_cache(
    cache: BaseCache | None, repo: RepoDir, fmt: str, sha: str, shadow_git: Path
) -> Entry | None:
    """Link the cached objects of ``sha`` into the fresh shadow dir; None on a miss."""
    entry = None if cache is None else cache.get(repo, fmt, sha)
    if entry is None:
        return None
    try:
        entry.link_into(shadow_git, sha)
    except OSError as exc:  # removed meanwhile (trimmed), another filesystem: fetch
        log.info("base cache: not used", reason=str(exc))
        for p in (shadow_git / "objects" / "pack").iterdir():
            p.unlink()
        with contextlib.suppress(FileNotFoundError):
            (shadow_git / "shallow").unlink()
        shutil.rmtree(entry.path, ignore_errors=True)  # this prepare stores it again
        return None
    write_ref(shadow_git, "refs/agentbox/head", sha)  # as the fetch would have
    return entry


#: How many untracked paths the base names (the count is whole).
UNTRACKED_SAMPLE = 20

#: ``CLOCK_REALTIME_COARSE`` (Linux): the clock file timestamps are taken from.
_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


def _past(newest_ns: int, *, fine: bool) -> None:
    """Return only once a file written from now on gets a later ctime than ``newest_ns``.

    Collection trusts a file whose stat matches the snapshot, and git compares
    ctime in whole seconds (Debian's git has no USE_NSEC): an agent's write in
    the same second, keeping size and mtime, would look unchanged to it. So the
    files whose saved ctime is in the newest second are also compared at full
    precision by collection (``_statcache``'s racy sidecar), and here we only
    wait until the kernel's timestamp clock has moved past ``newest_ns`` (a
    tick, a few milliseconds), so that such a write cannot get the saved ctime
    either. On a filesystem with whole-second timestamps (``fine`` false)
    nanoseconds say nothing: wait for the next second, as git needs.
    """
    if not fine:
        while time.time_ns() // 1_000_000_000 <= newest_ns // 1_000_000_000:
            time.sleep(0.05)
        return
    while time.clock_gettime_ns(_COARSE) <= newest_ns:
        time.sleep(0.001)
