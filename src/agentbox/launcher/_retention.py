"""Retention: remove finished tasks' files and records (``agentbox rm``, ``prune``), and ``du``.

What a task leaves in the data dir is its task dir (``tasks/<id>``: the
workspace, the shadow git dir, logs, report, diff, the gateway socket dir) and
its row in ``state.db``. Removing a task removes both, and nothing else:

* **never anything in the user's repo.** A published branch ``agentbox/<id>``
  was fetched into the repo and belongs to the user from then on; agentbox
  does not delete it, whatever the flags.
* **never a task that may still run.** Only terminal tasks (done, failed,
  timed_out, cancelled) are removed; the row is deleted first, by a
  compare-and-set on its status, so a task cannot start or change while it
  goes. A crash after that leaves a task dir without a row, which ``prune``
  removes once it is older than the cut-off.
* **``keep_branches``**: a task whose result was never published (``--no-publish``,
  or publishing was refused) holds its only copy in its shadow git dir, as
  the branch ``agentbox/<id>`` there. With ``keep_branches`` such a task keeps
  its row, report, diff and shadow git dir (``agentbox show``/``publish`` keep
  working); its workspace, logs and gateway dir go. Without it, the result is
  deleted with the rest.

Deletion trusts no name in the tree (the agent wrote the workspace): task ids
are validated and every path is derived from one (:class:`TaskPaths`), checked
to resolve inside the data dir; the walk goes by directory fds, never follows
a link, never crosses into another filesystem (a still-mounted workspace disk
is refused, not emptied), and flattens trees nested deeper than
:data:`MAX_DEPTH` by renaming their deep parts up, so the fds it holds stay
bounded whatever the agent built.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TASK_ID_RE, TaskPaths, check_inside, validate_task_id
from agentbox.errors import PathRefused, PolicyRefused, TaskNotFound
from agentbox.launcher import _session
from agentbox.launcher._store import Store, TaskRow

log = get_logger(__name__)

#: Statuses after which a task never changes again: only these are removed.
TERMINAL = frozenset({"done", "failed", "timed_out", "cancelled"})
#: The longest deadline a sandbox may have (a Boxfile's limit): a scratch workspace
#: younger than this may still be in use.
MAX_DEADLINE = 7 * 86400.0
#: Directories deeper than this below a removed tree's top are renamed up before removal.
MAX_DEPTH = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: What ``keep_branches`` keeps of an unpublished result: all else of the task dir goes.
_KEPT_FOR_RESULT = frozenset(
    {"shadow.git", "report.json", "result.diff", "result.diff.truncated", "base.json"}
)
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"2w"``, ``"90s"`` (a bare number: days) → seconds."""
    m = _AGE_RE.match(text)
    if m is None:
        raise ValueError(f"not an age: {text!r:.40} (use e.g. 7d, 12h, 30m)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


@dataclass
class Removal:
    """What removing one task did (or, in a dry run, would do)."""

    task_id: str
    bytes: int = 0
    kept_result: bool = False
    """Its unpublished result (shadow git dir, report, row) was kept (``keep_branches``)."""
    lost_result: bool = False
    """It had a result that no branch of its repo holds, and that went with it."""
    branch: str | None = None
    """The branch published in the user's repo, which stays there."""
    repo: str | None = None
    """The task's repo (None: a task dir without a record)."""
    commit: str | None = None
    """Its result commit (None: it changed nothing, or nothing was collected)."""
    in_repo: tuple[str, ...] = ()
    """The branches of its repo that hold the result commit (published by the launcher,
    fetched by the MCP server, or merged): the result stays there."""
    changed: bool | None = None
    """As the task's ``changed``: False, no changes; None, nothing collected."""


def _in_repo(row: TaskRow) -> tuple[str, ...]:
    """The local branches of the task's repo that contain its result commit.

    Read-only git in the repo (no hooks, no fsmonitor); a repo that is gone or a
    commit it lacks gives ().
    """
    if not row.commit_id or not Path(row.repo).is_dir():
        # Nothing to look up (a record without its commit, a repo gone): a branch the
        # launcher published is taken at its word.
        return (row.branch,) if row.branch else ()
    from agentbox.errors import CommandError
    from agentbox.launcher._validate import git_readonly

    try:
        out = git_readonly(
            Path(row.repo), "for-each-ref", "--contains", row.commit_id,
            "--format=%(refname:short)", "refs/heads/", timeout=30,
        ).stdout  # fmt: skip
    except CommandError:
        return ()  # the commit is not in the repo (or the repo is not readable)
    return tuple(out.split())[:20]


def _unpublished_result(row: TaskRow) -> bool:
    """It has a result commit that no branch of its repo holds (only its shadow git dir)."""
    return bool(row.changed) and not _in_repo(row)


def _task_dir(settings: Settings, task_id: str) -> Path:
    """The task dir, refused if it (or ``tasks/``) is a link or resolves elsewhere."""
    paths = TaskPaths(settings.data_dir, validate_task_id(task_id))
    expected = settings.data_dir.resolve() / "tasks" / task_id
    if paths.root != expected:
        raise PathRefused("the task dir resolves elsewhere (a link?)", path=expected)
    return expected


def remove_task(
    settings: Settings,
    store: Store,
    task_id: str,
    *,
    keep_branches: bool = False,
    dry_run: bool = False,
) -> Removal:
    """Remove one terminal task's files and record (see the module docstring)."""
    row = store.get(validate_task_id(task_id))
    if row.status not in TERMINAL:
        raise PolicyRefused(
            f"task {task_id} is {row.status}: only a finished task can be removed "
            "(cancel it first, or let a launcher reconcile it)"
        )
    root = _task_dir(settings, task_id)
    if os.path.ismount(root / "workspace"):
        raise PolicyRefused(
            f"task {task_id}'s workspace disk is still mounted (its launcher died?): "
            "start the launcher once to settle it, then remove the task"
        )
    in_repo = _in_repo(row) if row.changed else ()
    unpublished = bool(row.changed) and not in_repo
    keep = keep_branches and unpublished
    out = Removal(
        task_id, kept_result=keep, branch=row.branch, repo=row.repo,
        commit=row.commit_id if row.changed else None, in_repo=in_repo, changed=row.changed,
    )  # fmt: skip
    out.lost_result = unpublished and not keep
    if dry_run:
        out.bytes = _tree_bytes(root, skip=_KEPT_FOR_RESULT if keep else frozenset())
        return out
    if keep:
        out.bytes = _remove_entries(root, skip=_KEPT_FOR_RESULT)
        return out
    if not store.delete(task_id, expect=set(TERMINAL)):
        raise PolicyRefused(f"task {task_id} changed while it was being removed")
    out.bytes = remove_tree(root.parent, root.name)
    _session.forget(settings, task_id)  # its continuation plan, if it was one
    if row.group_id is not None and not store.group(row.group_id):
        # The group's last attempt: its shared-budget ledger goes with it.
        out.bytes += _remove_group(settings, row.group_id)
    log.info("task removed", task_id=task_id, bytes=out.bytes)
    return out


def _remove_group(settings: Settings, group: str) -> int:
    """Remove ``groups/<group>`` (a best-of-N group's ledger) if it is there; its bytes."""
    groups = settings.data_dir / "groups"
    if not TASK_ID_RE.fullmatch(group) or group not in {e.name for e in _entries(groups)}:
        return 0
    try:
        return remove_tree(groups, group)
    except (OSError, PathRefused) as exc:
        log.warning("group dir not removed", group=group, error=str(exc))
        return 0


def prune(
    settings: Settings,
    store: Store,
    *,
    older_than: float,
    keep_branches: bool = False,
    dry_run: bool = False,
    now: float | None = None,
) -> list[Removal]:
    """Remove every terminal task that finished more than ``older_than`` seconds ago,
    and task dirs that have no record and were last changed before that."""
    cutoff = (time.time() if now is None else now) - older_than
    done: list[Removal] = []
    known: set[str] = set()
    for row in store.all():
        known.add(row.id)
        finished = row.finished_at or row.created_at
        if row.status not in TERMINAL or finished > cutoff:
            continue
        if keep_branches and _unpublished_result(row) and _only_result_left(settings, row.id):
            continue  # pruned before: only its result is left, and that is kept
        try:
            done.append(
                remove_task(settings, store, row.id, keep_branches=keep_branches, dry_run=dry_run)
            )
        except (PolicyRefused, PathRefused, TaskNotFound) as exc:
            log.warning("not pruned", task_id=row.id, error=str(exc))
    tasks = settings.data_dir / "tasks"
    if tasks.is_dir() and not tasks.is_symlink():
        for entry in sorted(tasks.iterdir()):
            name = entry.name
            if name in known or not TASK_ID_RE.fullmatch(name) or store.exists(name):
                continue
            try:
                st = entry.lstat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_mtime > cutoff:
                continue  # a task being made right now has its row already; be safe anyway
            size = _tree_bytes(entry) if dry_run else remove_tree(tasks, name)
            done.append(Removal(name, bytes=size))
    for name, mtime in _session.pending_ids(settings):
        # A plan whose task is gone (removed by an older version, or its submit failed).
        if TASK_ID_RE.fullmatch(name) and mtime <= cutoff and not store.exists(name):
            if not dry_run:
                _session.forget(settings, name)
            done.append(Removal(name))
    done += _prune_scratch(
        settings, min(cutoff, (time.time() if now is None else now) - MAX_DEADLINE), dry_run
    )
    done += _prune_groups(settings, store, cutoff, dry_run)
    return done


def _prune_groups(settings: Settings, store: Store, cutoff: float, dry_run: bool) -> list[Removal]:
    """Best-of-N groups' dirs (``groups/<id>``: the shared-budget ledger) none of whose
    attempts is left, last changed before ``cutoff``."""
    groups = settings.data_dir / "groups"
    held = {row.group_id for row in store.all() if row.group_id is not None}
    out = []
    for entry in _entries(groups):
        if entry.name in held or not TASK_ID_RE.fullmatch(entry.name):
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_mtime > cutoff:
            continue
        size = _tree_bytes(entry) if dry_run else _remove_group(settings, entry.name)
        out.append(Removal(f"groups/{entry.name}", bytes=size))
    return out


def _prune_scratch(settings: Settings, cutoff: float, dry_run: bool) -> list[Removal]:
    """Scratch workspaces of ``agentbox exec``/``shell`` whose client was killed before it
    removed them: older than ``cutoff`` (never less than the longest deadline), not mounted."""
    scratch = settings.data_dir / "scratch"
    out = []
    for entry in _entries(scratch):
        try:
            st = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_mtime > cutoff or os.path.ismount(entry):
            continue
        try:
            size = _tree_bytes(entry) if dry_run else remove_tree(scratch, entry.name)
        except (OSError, PathRefused) as exc:
            log.warning("scratch workspace not pruned", path=str(entry), error=str(exc))
            continue
        out.append(Removal(f"scratch/{entry.name}", bytes=size))
    return out


def _only_result_left(settings: Settings, task_id: str) -> bool:
    root = _task_dir(settings, task_id)
    with contextlib.suppress(OSError):
        return all(e.name in _KEPT_FOR_RESULT for e in root.iterdir())
    return True


# -- removing a tree without following links or leaving the filesystem


def remove_tree(parent: Path, name: str) -> int:
    """Remove ``parent/name`` and everything in it; return the bytes freed (approximate).

    ``parent`` is opened without following a final link; ``name`` is removed by
    fd-relative calls only. A directory on another filesystem (a mount) inside
    the tree is refused with :class:`PathRefused`, before anything of it is touched.
    """
    if "/" in name or name in ("", ".", ".."):
        raise PathRefused(f"not a plain name: {name!r:.60}", path=parent)
    pfd = os.open(parent, _DIR_FLAGS)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=pfd)
            return st.st_blocks * 512
        if st.st_dev != os.fstat(pfd).st_dev:
            raise PathRefused("is a mount point: not removed", path=parent / name)
        top = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        try:
            freed = _empty(top, st.st_dev, parent / name, frozenset())
        finally:
            os.close(top)
        os.rmdir(name, dir_fd=pfd)
        return freed + st.st_blocks * 512
    finally:
        os.close(pfd)


def _remove_entries(root: Path, *, skip: frozenset[str]) -> int:
    """Remove the entries of the directory ``root`` except the names in ``skip``."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return 0
    try:
        return _empty(top, os.fstat(top).st_dev, root, skip)
    finally:
        os.close(top)


def _empty(top: int, dev: int, where: Path, skip: frozenset[str]) -> int:
    """Remove everything in the directory ``top`` (but ``skip``, at its first level)."""
    freed = 0
    seen: set[int] = set()
    deep = 0
    while True:
        names = [n for n in _names(top) if n not in skip]
        if not names:
            return freed
        # (dir fd, its names, its parent's fd, its name there); the top is never removed here.
        stack: list[tuple[int, Iterator[str], int, str]] = [(top, iter(names), -1, "")]
        try:
            while stack:
                fd, it, pfd, name = stack[-1]
                entry = next(it, None)
                if entry is None:
                    stack.pop()
                    if pfd >= 0:
                        os.close(fd)
                        os.rmdir(name, dir_fd=pfd)
                    continue
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                if st.st_ino not in seen:
                    freed += st.st_blocks * 512
                    if st.st_nlink > 1:
                        seen.add(st.st_ino)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry, dir_fd=fd)
                    continue
                if st.st_dev != dev:
                    raise PathRefused(
                        f"{entry!r:.80} inside is a mount point: not removed", path=where
                    )
                if len(stack) > MAX_DEPTH:
                    # Too deep to hold an fd per level: move it up to the top, for the next pass.
                    deep += 1
                    os.rename(
                        entry, f".agentbox-rm-{deep}-{st.st_ino}", src_dir_fd=fd, dst_dir_fd=top
                    )
                    continue
                child = os.open(entry, _DIR_FLAGS, dir_fd=fd)
                try:
                    child_names = _names(child)
                except OSError:
                    os.close(child)
                    raise
                stack.append((child, iter(child_names), fd, entry))
        finally:
            for fd, _, pfd, _ in stack:
                if pfd >= 0:
                    os.close(fd)


def _names(fd: int) -> list[str]:
    with os.scandir(fd) as it:
        return [e.name for e in it]


# -- du


@dataclass
class TaskUsage:
    """One task's bytes on disk, by part."""

    task_id: str
    status: str
    finished_at: float | None
    branch: str | None
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class DataUsage:
    """What the data dir holds: per task, and per other top-level entry."""

    data_dir: Path
    tasks: list[TaskUsage]
    other: dict[str, int]
    orphan_task_dirs: list[str]

    @property
    def total(self) -> int:
        return sum(t.total for t in self.tasks) + sum(self.other.values())


def data_usage(settings: Settings, store: Store) -> DataUsage:
    """Bytes held in the data dir (blocks on disk, hard links once, never crossing a mount)."""
    data = settings.data_dir
    rows = {r.id: r for r in store.all()} if (data / "state.db").exists() else {}
    tasks: list[TaskUsage] = []
    orphans: list[str] = []
    tasks_dir = data / "tasks"
    for task_id, row in rows.items():
        usage = TaskUsage(task_id, row.status, row.finished_at, row.branch)
        root = tasks_dir / task_id
        for part in _entries(root):
            usage.parts[part.name] = _tree_bytes(part)
        tasks.append(usage)
    for entry in _entries(tasks_dir):
        if entry.name not in rows:
            orphans.append(entry.name)
    other: dict[str, int] = {}
    for entry in _entries(data):
        if entry.name == "tasks":
            other["tasks (without a record)"] = sum(_tree_bytes(tasks_dir / n) for n in orphans)
        else:
            other[entry.name] = _tree_bytes(entry)
    return DataUsage(data, tasks, other, orphans)


def _entries(d: Path) -> list[Path]:
    try:
        check_inside(d.parent, d)
        if d.is_symlink() or not d.is_dir():
            return []
        return sorted(d.iterdir())
    except (OSError, PathRefused):
        return []


def _tree_bytes(root: Path, *, skip: Iterable[str] = ()) -> int:
    """Blocks held under ``root`` (hard links once), not following links or crossing mounts."""
    try:
        st = root.lstat()
    except OSError:
        return 0
    total = st.st_blocks * 512
    if not stat.S_ISDIR(st.st_mode):
        return total
    skipped = set(skip)
    seen: set[int] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if d == root and e.name in skipped:
                continue
            try:
                est = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if est.st_nlink > 1:
                if est.st_ino in seen:
                    continue
                seen.add(est.st_ino)
            total += est.st_blocks * 512
            if stat.S_ISDIR(est.st_mode) and est.st_dev == st.st_dev:
                stack.append(Path(e.path))
    return total
