"""Turning what the agent left in the workspace into a commit: :func:`collect`.

Git never reads the workspace. We walk it (:mod:`._walk`, through
:mod:`agentbox.safepath`: openat2 beneath the root, no links followed) while
``git diff-files`` (the shadow dir as repository, the stat-filled base index)
tells which tracked paths' lstat changed: it stats, it never opens a file.
Whatever git names, and every entry git does not know, we lstat ourselves;
only changed files are read (``O_NOFOLLOW``, beneath the root, capped) and
stored as blobs in the shadow dir by us; the trees of the changed directories,
the commit and the branch ref are written by us too (:mod:`._tree`), in git's
own formats. Only ``diff-tree`` (for the diff) and, for new files,
``check-ignore`` run afterwards, both in the shadow dir.

Decisions (documented in docs/explanation/result-collection.md):

* the workspace's own ``.git`` (file, dir or link) is never read; a nested
  ``.git`` (any case variant) is skipped and reported: an embedded repository
  is collected as plain files without its ``.git``;
* symlinks are recorded as links (mode 120000, the target as the blob);
* FIFOs, sockets and devices are skipped and reported;
* only 100644/100755 are recorded: setuid, setgid and sticky bits are dropped
  (noted);
* a file with more links than the walk found inside the workspace is a hard
  link to something outside: skipped and reported (its content is never read);
  hard links wholly inside the workspace are collected;
* names with control characters (newline included) and names git refuses
  (``.git`` look-alikes, a symlinked ``.gitmodules``) are skipped and reported;
* a skipped path keeps its base version; base files that are gone are deleted;
* new files the workspace's ``.gitignore`` files ignore are left out, as
  ``git add -A`` would (``git check-ignore`` in the shadow dir, on paths our
  walk found; ``.gitignore`` files are read by git with ``O_NOFOLLOW``, and if
  any ``.gitignore`` is a FIFO or device the ignore rules are not applied at
  all, since opening it could block).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
from pathlib import Path

from agentbox.collect._git import ShadowGit
from agentbox.collect._index import base_entries
from agentbox.collect._model import Base, Collected, DiffStat, Limits
from agentbox.collect._objects import BlobWriter
from agentbox.collect._statcache import (
    BaseListing,
    key_mode,
    load_keys,
    load_racy,
    stat_key,
    stat_keys_size,
)
from agentbox.collect._tree import Trees, build_tree, prefetch, write_commit, write_ref
from agentbox.collect._walk import Walk, judge_reported, walk
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.core.paths import validate_task_id
from agentbox.errors import CollectError, CommandError, PathRefused
from agentbox.safepath import SizeRefused, Tree

log = get_logger(__name__)


def branch_name(task_id: str) -> str:
    """``agentbox/<task-id>`` (the id validated)."""
    return f"agentbox/{validate_task_id(task_id)}"


def _git_changed(shadow: ShadowGit, workspace: Path, index: Path) -> set[str] | None:
    """Tracked paths whose lstat no longer matches the base index, or None if git failed.

    git is only a stat oracle here: ``diff-files`` lstats the tracked paths
    (in C, with its preload threads) and never reads a file, because the base
    index records no empty size and no racily-clean entry (see ``_index``).
    Every path it names is then lstat-ed and read by us through safepath.
    """
    rc, out = shadow.run_bytes(
        "-c", "core.trustctime=true", "-c", "core.checkStat=default",
        "-c", "core.preloadIndex=true", f"--work-tree={workspace}",
        "diff-files", "-z", "--name-only", "--ignore-submodules=all", index=index,
    )  # fmt: skip
    if rc != 0:
        log.warning("git diff-files failed; every tracked file is stat-ed instead", rc=rc)
        return None
    return {os.fsdecode(p) for p in out.split(b"\0") if p}


def _racy_changed(tree: Tree, keys: dict[str, bytes]) -> set[str]:
    """Which files saved in the snapshot's newest second changed (full-precision lstat).

    git's whole-second ctime cannot tell a write in that second from the saved
    state; ours can (see ``_statcache``). lstat only, beneath the root.
    """
    out = set()
    for rel, key in keys.items():
        try:
            st = tree.stat(rel)
        except (PathRefused, OSError):
            out.add(rel)  # gone or unreachable: the walk and judge_reported decide
            continue
        if stat_key(key_mode(key), st) != key:
            out.add(rel)
    return out


def _ignored(shadow: ShadowGit, workspace: Path, new: list[str]) -> set[str] | None:
    """Which of the ``new`` paths the workspace's ``.gitignore`` files ignore (None: failed)."""
    rc, out = shadow.run_bytes(
        f"--work-tree={workspace}", "check-ignore", "--no-index", "-z", "--stdin",
        input=b"\0".join(os.fsencode(r) for r in new) + b"\0", cwd=workspace,
    )  # fmt: skip
    if rc not in (0, 1):
        return None
    return {os.fsdecode(p) for p in out.split(b"\0") if p}


def _read_changed(
    w: Walk,
    tree: Tree,
    blobs: BlobWriter,
    until: float,
    base: dict[bytes, tuple[int, str]] | None = None,
) -> dict[bytes, tuple[int, str]]:
    """Store every entry of ``w.changed`` as a blob; return {path: (mode, blob id)}.

    ``base`` (the base index's entries, see :func:`base_entries`): an entry whose mode and
    blob id are the base's (its stat changed, not its content: a chown, a rewrite of the
    same bytes) is left out, neither stored nor returned: the tree is the same without it.

    Counts into ``w.files_read``/``w.bytes_read``; the caps (total size, number of
    changed files) span calls. Past ``until`` (``time.monotonic``), or past the
    number of changed files, the rest is not read: one note per reason says how
    many (the caps are for a hostile result of 200,000 files: bounded time and memory).
    """
    updates: dict[bytes, tuple[int, str]] = {}
    cap = w.limits.max_file_size
    entries = sorted(w.changed)
    for n, (rel, gm, st) in enumerate(entries):
        if w.files_read >= w.limits.max_changed_files:
            w.skip_many(entries[n:], f"over the cap of {w.limits.max_changed_files} changed files")
            break
        if n % 256 == 0 and time.monotonic() > until:
            w.skip_many(entries[n:], f"collection's time limit ({w.limits.max_seconds:g} s) passed")
            break
        relb = os.fsencode(rel)
        try:
            if gm == 0o120000:
                data = tree.readlink(relb)
            else:
                if st.st_size > cap:
                    w.skip(rel, f"over the per-file cap ({st.st_size} > {cap} bytes)")
                    continue
                if w.bytes_read + st.st_size > w.limits.max_total_size:
                    w.skip(rel, f"over the total cap ({w.limits.max_total_size} bytes)")
                    continue
                data = tree.read(relb, limit=cap)
        except SizeRefused:
            w.skip(rel, f"over the per-file cap ({cap} bytes)")
            continue
        except PathRefused as exc:
            w.skip(rel, f"could not be read safely: {exc}")
            continue
        w.bytes_read += len(data)
        w.files_read += 1
        oid = blobs.hash(data)
        if base is not None and base.get(relb) == (gm, oid):
            continue  # the base's own blob and mode: no change
        updates[relb] = (gm, blobs.write(data, oid=oid))
    return updates


def _tree_via_index(
    shadow: ShadowGit, base_index: Path, tmp: Path, updates: dict[bytes, tuple[int, str]],
    w: Walk, object_format: str,
) -> str:  # fmt: skip
    """The result tree through a temporary index (the general route, for odd names)."""
    index = tmp / "index"
    shutil.copyfile(base_index, index)
    records = [b"%o %s\t%s" % (m, oid.encode(), p) for p, (m, oid) in updates.items()]
    _update_index(shadow, index, records, w, object_format)
    return shadow.run("write-tree", index=index).stdout.strip()


def _update_index(
    shadow: ShadowGit, index: Path, records: list[bytes], w: Walk, object_format: str
) -> None:
    """``update-index -z --index-info``; a path git refuses is dropped and reported."""
    zero = "0" * (64 if object_format == "sha256" else 40)
    deletions = [b"0 %s\t%s" % (zero.encode(), os.fsencode(rel)) for rel in w.all_deleted()]
    pending = deletions + records
    for _attempt in range(50):
        if not pending:
            return
        try:
            shadow.run("update-index", "-z", "--index-info", index=index,
                       input=b"\0".join(pending) + b"\0")  # fmt: skip
            return
        except CommandError as exc:
            bad = _refused_path(exc.stderr)
            match = [r for r in pending if r.partition(b"\t")[2] == bad]
            if bad is None or not match:
                raise CollectError(f"git update-index failed: {exc}") from exc
            pending = [r for r in pending if r not in match]
            # git died before committing its index lock: the index is still the base one.
            w.skip(os.fsdecode(bad), "git refuses this path")
    raise CollectError("git update-index refused too many paths")


def _refused_path(stderr: str) -> bytes | None:
    for line in stderr.splitlines():
        for marker in ("unable to update ", "invalid path '"):
            if marker in line:
                tail = line.split(marker, 1)[1]
                return os.fsencode(tail.rstrip("'"))
    return None


class _Enough(Exception):
    """Raised from a stream callback: the diff has reached its cap."""


def _diff(shadow: ShadowGit, base: str, commit: str, cap: int) -> tuple[DiffStat, str, bool]:
    """The diffstat and the unified diff (cut at ``cap`` bytes) from one ``git diff-tree``.

    ``--numstat -p`` prints one numstat line per file (paths quoted, so one
    line each), a blank line, then the patch.
    """
    head: list[bytes] = []
    chunks: list[bytes] = []
    size = 0
    truncated = False
    in_patch = False

    def keep(chunk: bytes) -> None:
        nonlocal size, truncated, in_patch
        if not in_patch:
            # The blank line may straddle two chunks: look at the new chunk and the byte
            # before it only (joining every chunk so far each time is quadratic).
            tail = head[-1][-1:] if head else b""
            at = (tail + chunk).find(b"\n\n")
            head.append(chunk)
            if at < 0:
                return
            joined = b"".join(head)
            cut = len(joined) - len(chunk) - len(tail) + at
            first, chunk = joined[:cut], joined[cut + 2 :]
            head[:] = [first]
            in_patch = True
        if size < cap:
            chunks.append(chunk[: cap - size])
            size += len(chunks[-1])
        if size >= cap and chunk:
            truncated = True
            raise _Enough  # the rest of the patch is never made: git is stopped here

    argv = shadow.argv(["diff-tree", "-r", "--numstat", "-p", "--no-color", "--no-ext-diff",
                        "--no-textconv", "--no-renames", "--binary", base, commit])  # fmt: skip
    err: list[bytes] = []
    try:
        rc = _proc.stream(argv, on_stdout=keep, on_stderr=err.append, env=shadow.env(),
                          cwd=shadow.git_dir, timeout=shadow.timeout)  # fmt: skip
    except _Enough:
        rc = 0  # stopped by us, the numstat (printed first) complete
    if rc != 0:
        raise CollectError(f"git diff-tree failed: {b''.join(err).decode(errors='replace')}")
    files = ins = dels = 0
    for line in b"".join(head).splitlines():
        added, _, rest = line.partition(b"\t")
        deleted, _, _path = rest.partition(b"\t")
        if not _path:
            continue
        files += 1
        ins += int(added) if added.isdigit() else 0
        dels += int(deleted) if deleted.isdigit() else 0
    text = b"".join(chunks).decode("utf-8", "replace")
    if truncated:
        text += f"\n[diff truncated at {cap} bytes; see the branch for the rest]\n"
    return DiffStat(files_changed=files, insertions=ins, deletions=dels), text, truncated


#: A base whose saved stat keys (``<base_index>.stat``, ~100 bytes an entry) are at most
#: this size is judged by our own lstat of every entry (:func:`walk` without trust):
#: about a millisecond, against ``git diff-files``'s process (3-5 ms, more on a busy host).
SMALL_BASE_KEYS = 48 * 1024


def _small_base(base_index: Path) -> bool:
    """Whether the base is small enough to judge without git (see :data:`SMALL_BASE_KEYS`)."""
    try:
        return stat_keys_size(base_index) <= SMALL_BASE_KEYS
    except OSError:
        return False  # no sidecar to judge by: git's answer (its failure reads the sidecar)


def _may_have_ref(git_dir: Path, ref: str) -> bool:
    """Whether the shadow dir (ours) may hold ``ref``: False only when it surely does not
    (files ref storage, no loose ref file, none packed), so that the first collection of a
    task that changed nothing runs no ``update-ref -d`` (a git process) for nothing."""
    if (git_dir / "reftable").exists():
        return True
    if os.path.lexists(git_dir / ref):
        return True
    try:
        packed = (git_dir / "packed-refs").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return f" {ref}\n".encode() in packed


def collect(
    workspace: Path,
    shadow_git: Path,
    base_index: Path,
    base: Base,
    *,
    task_id: str,
    message: str,
    limits: Limits | None = None,
) -> Collected:
    """Commit what the agent left in ``workspace`` to ``refs/heads/agentbox/<task-id>``.

    git runs against the shadow dir only (``base_index`` is its stat oracle's
    index); the parent is ``base.base_commit``; author and committer
    ``agentbox <agentbox@localhost>``; the message is ``message`` (NULs
    dropped) plus an ``agentbox-task: <id>`` trailer. Collecting twice replaces
    the branch. When the workspace's tree is the base's (the agent changed
    nothing, whatever it did in its own ``.git``), there is no commit and no
    branch: ``changed`` is False, ``commit`` and ``branch`` are empty and the
    diff is empty. Run it after the sandbox has stopped. Raises
    :class:`~agentbox.errors.CollectError` (the workspace is kept).
    """
    limits = limits or Limits()
    started = time.monotonic()
    workspace, shadow_git, base_index = (
        Path(p).absolute() for p in (workspace, shadow_git, base_index)
    )
    branch = branch_name(task_id)
    if not base_index.is_file():
        raise CollectError(f"base index missing: {base_index}")
    listing = BaseListing.load(base_index)
    with ShadowGit(shadow_git) as shadow, Tree(workspace) as tree, \
            tempfile.TemporaryDirectory(prefix="agentbox-index-") as tmp:  # fmt: skip
        # An index younger (in whole seconds) than every saved entry means no entry is
        # "racily clean": git would read such a file (and its .gitattributes, maybe a
        # FIFO) to compare. Past the snapshot's newest second, even if that is now.
        racy = load_racy(base_index)
        stamp = time.time_ns() if racy is None else max(time.time_ns(), (racy[0] + 1) * 10**9)
        os.utime(base_index, ns=(stamp, stamp))
        fmt = base.object_format

        def oracle() -> tuple[set[str] | None, Trees]:
            # git lstats the tracked files; the base trees above what it names
            # are fetched at once, all while we walk directories by d_type.
            changed = _git_changed(shadow, workspace, base_index)
            if not changed:
                return changed, {}
            try:
                return changed, prefetch(shadow, base.tree, [os.fsencode(r) for r in changed], fmt)
            except ValueError:
                return changed, {}

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            if _small_base(base_index):
                # A few hundred entries: our own lstat of each, compared at full precision
                # with the saved keys, costs less than starting git to do it.
                changed: set[str] | None = None
                trees: Trees = {}
            else:
                asked = pool.submit(oracle)
                w = walk(listing, limits, tree, trust=True)
                changed, trees = asked.result()
                if changed is not None and racy is not None:
                    changed |= _racy_changed(tree, racy[1])
            if changed is None:  # no oracle: judge every entry against the saved stat keys
                tree.skipped.clear()
                w = walk(listing, limits, tree, trust=False, keys=load_keys(base_index))
            else:
                judge_reported(w, tree, changed)
            w.resolve_hardlinks()
            objects = BlobWriter(shadow_git, fmt)
            deletions = [os.fsencode(rel) for rel in w.all_deleted()]
            new = [c for c in w.changed if w.base.mode(c[0]) is None]
            w.changed = [c for c in w.changed if w.base.mode(c[0]) is not None]
            # Ignore rules and the remaining base trees, while we read the changes.
            ignoring = None
            if new and w.odd_gitignore:
                w.note(".gitignore", "a .gitignore is not a regular file: ignore rules not applied")
            elif new:
                ignoring = pool.submit(_ignored, shadow, workspace, [c[0] for c in new])
            until = started + limits.max_seconds
            # The tracked files first: those whose blob is the base's are no change, and
            # the base trees are fetched (meanwhile) only above what is left.
            same = base_entries(base_index, fmt) if w.changed else None
            updates = _read_changed(w, tree, objects, until, same)
            paths = [*updates, *(os.fsencode(c[0]) for c in new), *deletions]
            fetching = pool.submit(prefetch, shadow, base.tree, paths, fmt, trees)
            ignored = ignoring.result() if ignoring is not None else set()
            if ignored is None:
                w.note(".gitignore", "git check-ignore failed: ignore rules not applied")
                ignored = set()
            w.ignored = len(ignored)
            w.changed = [c for c in new if c[0] not in ignored]
            updates.update(_read_changed(w, tree, objects, until))
            try:
                trees.update(fetching.result())
                tree_id = build_tree(shadow, objects, base.tree, updates, deletions, trees)
            except ValueError:  # a directory name only the index route can carry
                tree_id = _tree_via_index(shadow, base_index, Path(tmp), updates, w, fmt)
        any_change = tree_id != base.tree
        if any_change:
            body = message.replace("\0", "").strip() or "agentbox task"
            commit = write_commit(objects, tree_id, base.base_commit,
                                  f"{body}\n\nagentbox-task: {task_id}\n")  # fmt: skip
            write_ref(shadow_git, f"refs/heads/{branch}", commit)
            diffstat, diff, truncated = _diff(
                shadow, base.base_commit, commit, limits.max_diff_bytes
            )
        else:
            # No changes: nothing to review, so no commit and no branch (an empty
            # commit would only publish a branch that says nothing). A branch left by
            # an earlier collection of this task goes too: the result is what is there now.
            commit, diffstat, diff, truncated = "", DiffStat(), "", False
            if _may_have_ref(shadow_git, f"refs/heads/{branch}"):
                shadow.run("update-ref", "-d", f"refs/heads/{branch}")
    w.skip_summary()
    log.info("collected", task_id=task_id, commit=commit or None, changed=any_change,
             files=diffstat.files_changed, skipped=len(w.skipped))  # fmt: skip
    return Collected(
        commit=commit,
        branch=branch if any_change else "",
        base_commit=base.base_commit,
        tree=tree_id,
        changed=any_change,
        diffstat=diffstat,
        diff=diff,
        diff_truncated=truncated,
        skipped=w.skipped,
        notes=w.notes,
        files_seen=w.count,
        files_ignored=w.ignored,
        files_read=w.files_read,
        bytes_read=w.bytes_read,
    )
