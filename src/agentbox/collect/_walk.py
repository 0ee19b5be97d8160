"""Walking the workspace against the base: what changed, what is gone, what is refused.

Used by :func:`agentbox.collect.collect`. Every directory is either found
unchanged from its saved key (and not read) or read through openat2 beneath
the root; every entry git's stat oracle cannot vouch for is lstat-ed here
(``fstatat`` on the directory fd, no link followed) and judged by
:meth:`Walk.entry`. See docs/explanation/result-collection.md for the table
of decisions.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import stat
import unicodedata

from agentbox.collect._model import Limits, Skipped
from agentbox.collect._risky import flag_change, flag_note, risky_reason
from agentbox.collect._statcache import MODES, BaseListing, dir_key, stat_key
from agentbox.errors import PathRefused
from agentbox.safepath import MAX_NAME, Tree, openat2, show

# C0, DEL and C1: a C1 0x9b is a CSI to terminals that read 8-bit controls.
_CONTROL = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]}
# Code points HFS+ ignores: ".g\u200cit" is ".git" there (git's is_hfs_dotgit).
_HFS_IGNORABLE = dict.fromkeys(
    [0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF]
)
_SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


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
    if any("\udc80" <= c <= "\udcff" for c in name):
        # os.fsdecode keeps undecodable bytes as lone surrogates: the name is not UTF-8.
        return "name is not valid UTF-8 (refused: it cannot be shown or reviewed as written)"
    if len(os.fsencode(name)) > MAX_NAME:
        return "name over 255 bytes"
    return None


class Walk:
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
        self.flagged: set[str] = set()
        self.skip_counts: dict[str, int] = {}
        self.note_counts: dict[str, int] = {}

    def skip(self, rel: str, reason: str) -> None:
        """Report ``rel``; a skipped path keeps its base version (if any).

        Past ``limits.max_skip_notes`` paths of one reason, the rest of that reason
        are counted, not listed (:meth:`skip_summary` adds the count)."""
        n = self.skip_counts[reason] = self.skip_counts.get(reason, 0) + 1
        if n <= self.limits.max_skip_notes:
            self.skipped.append(Skipped(path=show(os.fsencode(rel)), reason=reason))

    def skip_many(self, entries: list[tuple[str, int, os.stat_result]], reason: str) -> None:
        """Skip every path of ``entries`` for one ``reason`` (listed up to the cap)."""
        for rel, _gm, _st in entries:
            self.skip(rel, reason)

    def skip_summary(self) -> None:
        """One entry per reason that had more paths than were listed: how many more."""
        for counts, out in ((self.skip_counts, self.skipped), (self.note_counts, self.notes)):
            for reason, n in counts.items():
                if n > self.limits.max_skip_notes:
                    more = n - self.limits.max_skip_notes
                    out.append(Skipped(path=f"({more} more paths)", reason=reason))

    def note(self, rel: str, reason: str) -> None:
        """Note ``rel`` (collected, with a remark); past ``limits.max_skip_notes`` notes
        of one reason the rest are counted (flagged paths are always listed)."""
        if flag_change(reason) is None:
            n = self.note_counts[reason] = self.note_counts.get(reason, 0) + 1
            if n > self.limits.max_skip_notes:
                return
        self.notes.append(Skipped(path=show(os.fsencode(rel)), reason=reason))

    def flag(self, rel: str, change: str) -> None:
        """Note ``rel`` if it is a path that runs code when opened or merged (see ``_risky``)."""
        if rel not in self.flagged and risky_reason(rel) is not None:
            self.flagged.add(rel)
            self.note(rel, flag_note(change))

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
        self.flag(rel, "added" if base is None else "modified")
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
        for rel in gone:
            self.flag(rel, "deleted")
        return gone


def _plain_dir_name(prefix: str, name: str) -> bool:
    """A directory name :meth:`Walk.entry` would not stop at (no .git, no control char)."""
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


def walk(
    base: BaseListing,
    limits: Limits,
    tree: Tree,
    *,
    trust: bool,
    keys: dict[str, bytes] | None = None,
) -> Walk:
    """Walk the workspace; only what git cannot vouch for is stat-ed here.

    With ``trust`` (``git diff-files`` judging tracked files meanwhile): a
    directory whose saved key (mtime, ctime, inode, device) still matches has
    the same names as at the trusted moment and is not read again, only its
    subdirectories are visited; a changed or new directory is read (openat2
    beneath the root, no links, no other filesystem), and in it a name that is
    in the base with the same kind (file or link, from ``d_type``) is left to
    git, everything else (new names, changed kinds, special files) is lstat-ed
    and judged by :meth:`Walk.entry`. Without ``trust``, every directory is
    read and every entry lstat-ed and compared with the saved ``keys``.
    """
    w = Walk(base, limits, keys)
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
            w.count += len(subs) + base.count(prefix)
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


def _read_dir(w: Walk, tree: Tree, prefix: str, stack: list[str], *, trust: bool) -> None:
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
        left = w.limits.max_files - w.count
        with os.scandir(fd) as it:
            # Never list more than the limit: one directory may hold millions of names.
            entries = list(itertools.islice(it, max(left, 0) + 1))
        if len(entries) > left:
            w.count += len(entries)  # the caller sees the limit passed and stops
            return
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


def judge_reported(w: Walk, tree: Tree, changed: set[str]) -> None:
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
