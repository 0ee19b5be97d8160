"""Turning what the agent left in the workspace into a commit: :func:`collect`.

Git never reads the workspace. We walk it with :mod:`agentbox.safepath`
(openat2 beneath the root, no links followed), while ``git diff-files`` (with
the shadow dir as repository and the stat-seeded base index) tells which
tracked paths' lstat changed: it stats, it never opens a file. Whatever git
names, and every entry git does not know, we lstat ourselves and compare with
the snapshot taken at the trusted moment; only changed files are read
(``O_NOFOLLOW``, beneath the root, capped), stored as blobs in the shadow dir by
us, and fed to ``git update-index --index-info`` as (mode, blob, path) over a
temporary copy of the base index. ``write-tree``, ``commit-tree`` and
``update-ref`` then run in the shadow dir only.

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

import collections
import concurrent.futures
import errno
import os
import shutil
import stat
import tempfile
import unicodedata
from pathlib import Path

from agentbox import _proc
from agentbox._log import get_logger
from agentbox.collect._git import ShadowGit
from agentbox.collect._model import Base, Collected, DiffStat, Limits, Skipped
from agentbox.collect._objects import BlobWriter
from agentbox.collect._statcache import MODES, BaseListing, dir_key, load_keys, stat_key
from agentbox.collect._tree import Trees, build_tree, prefetch, write_commit, write_ref
from agentbox.errors import CollectError, CommandError, PathRefused
from agentbox.paths import validate_task_id
from agentbox.safepath import MAX_NAME, SizeRefused, Tree, openat2, show

__all__ = ["branch_name", "collect"]

log = get_logger("collect")

_CONTROL = {chr(c) for c in [*range(0x20), 0x7F]}
# Code points HFS+ ignores: ".g\u200cit" is ".git" there (git's is_hfs_dotgit).
_HFS_IGNORABLE = dict.fromkeys(
    [0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF]
)
_SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


def branch_name(task_id: str) -> str:
    """``agentbox/<task-id>`` (the id validated)."""
    return f"agentbox/{validate_task_id(task_id)}"


def _is_dotgit(name: str) -> bool:
    """``.git`` as Windows and macOS checkouts would see it (git refuses these too)."""
    folded = unicodedata.normalize("NFC", name.translate(_HFS_IGNORABLE)).lower()
    stripped = folded.rstrip(" .")
    return stripped in (".git", "git~1") or (
        stripped.startswith(".git") and stripped[4:5] in (":",)
    )


def _bad_name(name: str) -> str | None:
    if any(c in _CONTROL for c in name):
        return "control character in name (refused: newlines break every line-based tool)"
    if len(os.fsencode(name)) > MAX_NAME:
        return "name over 255 bytes"
    return None


class _Walk:
    """The outcome of walking the workspace against the base."""

    def __init__(self, base: BaseListing, limits: Limits, keys: dict[str, bytes] | None):
        self.base = base
        self.limits = limits
        self.keys = keys  # stat keys: only when every entry is judged by us (no git)
        self.judged: set[str] = set()
        self.visited: set[str] = set()
        self.deleted: list[str] = []
        self.changed: list[tuple[str, int, os.stat_result]] = []
        self.hard: list[tuple[str, int, os.stat_result]] = []
        self.links: collections.Counter[tuple[int, int]] = collections.Counter()
        self.blocked: set[str] = set()
        self.kept_prefixes: list[str] = []
        self.skipped: list[Skipped] = []
        self.notes: list[Skipped] = []
        self.count = 0
        self.truncated = False
        self.ignored = 0
        self.odd_gitignore = False
        self.files_read = 0
        self.bytes_read = 0

    def skip(self, rel: str, reason: str) -> None:
        """Report ``rel``; a skipped path keeps its base version (if any)."""
        self.skipped.append(Skipped(path=show(os.fsencode(rel)), reason=reason))

    def note(self, rel: str, reason: str) -> None:
        self.notes.append(Skipped(path=show(os.fsencode(rel)), reason=reason))

    def descend(self, rel: str) -> bool:
        return rel not in self.blocked

    def entry(self, prefix: str, name: str, st: os.stat_result, base: int | None) -> None:
        """Judge one entry from its lstat; ``base`` is its base git mode, if any."""
        rel = prefix + name
        self.judged.add(rel)
        mode = st.st_mode
        if not prefix and name == ".git":
            self.blocked.add(rel)  # the agent's own repository: data, never read
            return
        if _is_dotgit(name):
            self.blocked.add(rel)
            self.skip(rel, "nested .git (an embedded repository is collected without it)")
            return
        bad = _bad_name(name)
        if bad is not None:
            self.blocked.add(rel)
            self.skip(rel, bad)
            if stat.S_ISDIR(mode):
                self.kept_prefixes.append(rel + "/")
            return
        if name == ".gitignore" and not (
            stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)
        ):
            self.odd_gitignore = True
        if stat.S_ISDIR(mode):
            if base == 0o160000:
                self.blocked.add(rel)  # a submodule: its pointer is kept as in the base
            elif base is not None:
                self.deleted.append(rel)  # a base file replaced by a directory
            return
        if stat.S_ISREG(mode):
            gm = 0o100755 if mode & stat.S_IXUSR else 0o100644
            if mode & _SPECIAL_BITS:
                self.note(rel, "setuid/setgid/sticky bit dropped")
        elif stat.S_ISLNK(mode):
            gm = 0o120000
            if name.lower() == ".gitmodules":
                self.skip(rel, "a symlinked .gitmodules (git refuses it)")
                return
        else:
            self.skip(rel, f"{_kind(mode)} (not collected)")
            return
        if self.keys is not None and self.keys.get(rel) == stat_key(gm, st):
            return  # unchanged since the trusted moment
        if gm != 0o120000 and st.st_nlink > 1:
            self.hard.append((rel, gm, st))
            self.links[(st.st_dev, st.st_ino)] += 1
            return
        self.changed.append((rel, gm, st))

    def resolve_hardlinks(self) -> None:
        for rel, gm, st in self.hard:
            inside = self.links[(st.st_dev, st.st_ino)]
            if inside < st.st_nlink:
                self.skip(
                    rel,
                    f"hard link to a file outside the workspace ({st.st_nlink} links, "
                    f"{inside} inside): content not read",
                )
            else:
                self.note(rel, f"hard link ({st.st_nlink} links, all inside): collected as a file")
                self.changed.append((rel, gm, st))

    def all_deleted(self) -> list[str]:
        """Base paths to remove: gone from a visited directory, or a directory not visited."""
        if self.truncated:
            return []  # an incomplete walk must not delete what it did not see
        gone = list(self.deleted)
        kept = tuple(self.kept_prefixes) + tuple(b + "/" for b in self.blocked)
        for prefix in self.base.dirs:
            if prefix in self.visited or (kept and prefix.startswith(kept)):
                continue
            gone.extend(prefix + n for n in self.base.names(prefix))
        return gone


def _plain_dir_name(prefix: str, name: str) -> bool:
    """A directory name :meth:`_Walk.entry` would not stop at (no .git, no control char)."""
    if name.isascii() and name.isprintable() and len(name) <= MAX_NAME:
        # The common case, without the Unicode folding of _is_dotgit.
        low = name.lower()
        if not (low.startswith(".git") or low.startswith("git~")):
            return True
    return (bool(prefix) or name != ".git") and not _is_dotgit(name) and _bad_name(name) is None


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "unknown file type"


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


def _walk(
    base: BaseListing,
    limits: Limits,
    tree: Tree,
    *,
    trust: bool,
    keys: dict[str, bytes] | None = None,
) -> _Walk:
    """Walk the workspace; only what git cannot vouch for is stat-ed here.

    With ``trust`` (``git diff-files`` judging tracked files meanwhile): a
    directory whose saved key (mtime, ctime, inode, device) still matches has
    the same names as at the trusted moment and is not read again, only its
    subdirectories are visited; a changed or new directory is read (openat2
    beneath the root, no links, no other filesystem), and in it a name that is
    in the base with the same kind (file or link, from ``d_type``) is left to
    git, everything else (new names, changed kinds, special files) is lstat-ed
    and judged by :meth:`_Walk.entry`. Without ``trust``, every directory is
    read and every entry lstat-ed and compared with the saved ``keys``.
    """
    w = _Walk(base, limits, keys)
    stack = [""]
    while stack:
        prefix = stack.pop()
        if prefix.count("/") > tree.max_depth:
            w.skip(prefix[:-1], f"directory nested deeper than {tree.max_depth}")
            w.kept_prefixes.append(prefix)
            continue
        saved = base.dir_key(prefix) if trust else None
        if saved is not None and _same_dir(tree, prefix, saved):
            # Same names as at the trusted moment: nothing new, nothing gone.
            w.visited.add(prefix)
            subs = base.subdirs(prefix)
            w.count += len(subs) + len(base.known(prefix))
            stack.extend(prefix + sub + "/" for sub in reversed(subs))
        else:
            _read_dir(w, tree, prefix, stack, trust=trust)
        if w.count > limits.max_files:
            w.truncated = True
            w.skip(prefix or ".", f"more than {limits.max_files} entries: walk stopped")
            break
    for rel_b, reason in tree.skipped:
        w.skip(os.fsdecode(rel_b), reason)
        w.kept_prefixes.append(os.fsdecode(rel_b) + "/")
    return w


def _same_dir(tree: Tree, prefix: str, saved: bytes) -> bool:
    """Is directory ``prefix`` still the one saved (same inode, device, mtime, ctime)?

    The path is stat-ed from the root fd: every directory above it was either
    found unchanged (so its entries are still the real directories they were)
    or read through openat2 just before, so no link is on the way.
    """
    try:
        st = os.stat(prefix[:-1] or ".", dir_fd=tree.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and dir_key(st) == saved


def _read_dir(w: _Walk, tree: Tree, prefix: str, stack: list[str], *, trust: bool) -> None:
    """Read one changed (or new) directory and judge its entries."""
    try:
        fd = (
            openat2(tree.fd, os.fsencode(prefix[:-1]), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            if prefix
            else os.dup(tree.fd)
        )
    except OSError as exc:
        reason = (
            "another filesystem is mounted there"
            if exc.errno == errno.EXDEV
            else f"cannot enter directory ({exc.strerror})"
        )
        tree.skipped.append((os.fsencode(prefix[:-1]), reason))
        return
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        w.visited.add(prefix)
        w.count += len(entries)
        known = w.base.known(prefix)
        if known:
            w.deleted.extend(prefix + n for n in known.keys() - {de.name for de in entries})
        get = known.get
        for de in entries:
            name = de.name
            code = get(name)
            if code is None:
                if de.is_dir(follow_symlinks=False) and _plain_dir_name(prefix, name):
                    stack.append(prefix + name + "/")  # nothing to judge: just enter it
                    continue
            elif trust and (
                de.is_file(follow_symlinks=False) if code < 2 else code == 2 and de.is_symlink()
            ):
                continue  # a tracked file or link, still one: git's diff-files judges it
            try:
                st = de.stat(follow_symlinks=False)  # fstatat(fd, name, AT_SYMLINK_NOFOLLOW)
            except FileNotFoundError:
                continue
            w.entry(prefix, name, st, None if code is None else MODES[code])
            if stat.S_ISDIR(st.st_mode) and w.descend(prefix + name):
                stack.append(prefix + name + "/")
    finally:
        os.close(fd)


def _judge_reported(w: _Walk, tree: Tree, changed: set[str]) -> None:
    """lstat and judge the tracked paths git found changed (that we left to it)."""
    gone = set(w.deleted)
    for rel in changed:
        prefix, _, name = rel.rpartition("/")
        prefix = prefix + "/" if prefix else ""
        if rel in w.judged or rel in gone or prefix not in w.visited:
            continue  # judged already, deleted, or under a directory not walked
        try:
            st = tree.stat(rel)
        except (PathRefused, FileNotFoundError):
            w.deleted.append(rel)
            continue
        w.entry(prefix, name, st, w.base.mode(rel))


def _ignored(shadow: ShadowGit, workspace: Path, new: list[str]) -> set[str] | None:
    """Which of the ``new`` paths the workspace's ``.gitignore`` files ignore (None: failed)."""
    rc, out = shadow.run_bytes(
        f"--work-tree={workspace}", "check-ignore", "--no-index", "-z", "--stdin",
        input=b"\0".join(os.fsencode(r) for r in new) + b"\0", cwd=workspace,
    )  # fmt: skip
    if rc not in (0, 1):
        return None
    return {os.fsdecode(p) for p in out.split(b"\0") if p}


def _read_changed(w: _Walk, tree: Tree, blobs: BlobWriter) -> dict[bytes, tuple[int, str]]:
    """Store every entry of ``w.changed`` as a blob; return {path: (mode, blob id)}.

    Counts into ``w.files_read``/``w.bytes_read``; the total cap spans calls.
    """
    updates: dict[bytes, tuple[int, str]] = {}
    cap = w.limits.max_file_size
    for rel, gm, st in sorted(w.changed):
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
        updates[relb] = (gm, blobs.write(data))
    return updates


def _tree_via_index(
    shadow: ShadowGit, base_index: Path, tmp: Path, updates: dict[bytes, tuple[int, str]],
    w: _Walk, object_format: str,
) -> str:  # fmt: skip
    """The result tree through a temporary index (the general route, for odd names)."""
    index = tmp / "index"
    shutil.copyfile(base_index, index)
    records = [b"%o %s\t%s" % (m, oid.encode(), p) for p, (m, oid) in updates.items()]
    _update_index(shadow, index, records, w, object_format)
    return shadow.run("write-tree", index=index).stdout.strip()


def _update_index(
    shadow: ShadowGit, index: Path, records: list[bytes], w: _Walk, object_format: str
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
            head.append(chunk)
            joined = b"".join(head)
            if b"\n\n" not in joined:
                return
            first, _, chunk = joined.partition(b"\n\n")
            head[:] = [first]
            in_patch = True
        if size < cap:
            chunks.append(chunk[: cap - size])
            size += len(chunks[-1])
        if size >= cap and chunk:
            truncated = True

    argv = shadow.argv(["diff-tree", "-r", "--numstat", "-p", "--no-color", "--no-ext-diff",
                        "--no-textconv", "--no-renames", "--binary", base, commit])  # fmt: skip
    err: list[bytes] = []
    rc = _proc.stream(argv, on_stdout=keep, on_stderr=err.append, env=shadow.env(),
                      cwd=shadow.git_dir, timeout=shadow.timeout)  # fmt: skip
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

    Runs in the shadow dir only, over a temporary copy of ``base_index``; the
    parent is ``base.base_commit``; author and committer ``agentbox
    <agentbox@localhost>``; the message is ``message`` plus an
    ``agentbox-task: <id>`` trailer. Collecting twice replaces the branch.
    Raises :class:`~agentbox.errors.CollectError` (the workspace is kept).
    """
    limits = limits or Limits()
    workspace, shadow_git, base_index = (
        Path(p).absolute() for p in (workspace, shadow_git, base_index)
    )
    branch = branch_name(task_id)
    if not base_index.is_file():
        raise CollectError(f"base index missing: {base_index}")
    listing = BaseListing.load(base_index)
    with ShadowGit(shadow_git) as shadow, Tree(workspace) as tree, \
            tempfile.TemporaryDirectory(prefix="agentbox-index-") as tmp:  # fmt: skip
        # A fresh mtime on the index means no entry is "racily clean": git would
        # read such a file (and its .gitattributes, maybe a FIFO) to compare.
        os.utime(base_index)
        oracle_index = base_index
        fmt = base.object_format

        def oracle() -> tuple[set[str] | None, Trees]:
            # git lstats the tracked files; the base trees above what it names
            # are fetched at once, all while we walk directories by d_type.
            changed = _git_changed(shadow, workspace, oracle_index)
            if not changed:
                return changed, {}
            try:
                return changed, prefetch(shadow, base.tree, [os.fsencode(r) for r in changed], fmt)
            except ValueError:
                return changed, {}

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            asked = pool.submit(oracle)
            w = _walk(listing, limits, tree, trust=True)
            changed, trees = asked.result()
            if changed is None:  # no oracle: judge every entry against the saved stat keys
                tree.skipped.clear()
                w = _walk(listing, limits, tree, trust=False, keys=load_keys(base_index))
            else:
                _judge_reported(w, tree, changed)
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
            paths = [os.fsencode(c[0]) for c in [*w.changed, *new]] + deletions
            fetching = pool.submit(prefetch, shadow, base.tree, paths, fmt, trees)
            updates = _read_changed(w, tree, objects)
            ignored = ignoring.result() if ignoring is not None else set()
            if ignored is None:
                w.note(".gitignore", "git check-ignore failed: ignore rules not applied")
                ignored = set()
            w.ignored = len(ignored)
            w.changed = [c for c in new if c[0] not in ignored]
            updates.update(_read_changed(w, tree, objects))
            try:
                trees.update(fetching.result())
                tree_id = build_tree(shadow, objects, base.tree, updates, deletions, trees)
            except ValueError:  # a directory name only the index route can carry
                tree_id = _tree_via_index(shadow, base_index, Path(tmp), updates, w, fmt)
        body = message.strip() or "agentbox task"
        commit = write_commit(objects, tree_id, base.base_commit,
                              f"{body}\n\nagentbox-task: {task_id}\n")  # fmt: skip
        write_ref(shadow_git, f"refs/heads/{branch}", commit)
        diffstat, diff, truncated = _diff(shadow, base.base_commit, commit, limits.max_diff_bytes)
    log.info("collected", task_id=task_id, commit=commit, files=diffstat.files_changed,
             skipped=len(w.skipped))  # fmt: skip
    return Collected(
        commit=commit,
        branch=branch,
        base_commit=base.base_commit,
        tree=tree_id,
        changed=tree_id != base.tree,
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
