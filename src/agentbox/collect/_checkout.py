"""Writing the base tree into the workspace, and the workspace's own ``.git``.

The workspace gets exactly the bytes of the base tree. Where the filesystem
can (XFS, btrfs: ``FICLONE``), a regular file of at least :data:`CLONE_MIN`
bytes is a copy-on-write clone of the user's own working-tree file, *verified
after cloning*: the clone is hashed as a git blob and kept only if it is the
base blob, so a file that differs (a smudge filter, an eol conversion, an
edit) or that changes after the clone (the clone does not see it) falls back
to writing. Every other file is written by us from ``git cat-file --batch``
(no smudge filter, no eol conversion, no ``export-ignore``). Sources are
opened beneath the opened repo directory with no link followed and no other
filesystem crossed (``openat2``), first as ``O_PATH`` so no device or FIFO is
ever opened, and only a single-link regular file owned by the repo's owner is
cloned.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentbox.collect._git import RepoDir, ShadowGit, init_repo
from agentbox.collect._objects import BlobWriter
from agentbox.collect._tree import write_commit, write_ref
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import CollectError, CommandError
from agentbox.safepath import NO_CLONE, SafeWriter, Tree, openat2

log = get_logger(__name__)

_SUBMODULE = 0o160000
_LINK = 0o120000
#: Smaller files are written: for them a clone (open, clone, hash, close) costs more
#: than writing the bytes (measured: 10,000 small files, 2.5x slower cloned on XFS).
CLONE_MIN = 64 << 10


@dataclass
class Checkout:
    """What :func:`write_workspace` did: every entry's git mode, and how files got there."""

    modes: dict[str, int]
    cloned: int = 0
    written: int = 0


def tree_listing(shadow: ShadowGit, tree: str) -> bytes:
    """``git ls-tree -r -z --full-tree`` of ``tree`` in the shadow dir."""
    rc, out = shadow.run_bytes("ls-tree", "-r", "-z", "--full-tree", tree)
    if rc != 0:
        raise CollectError(f"git ls-tree {tree} failed in the shadow dir")
    return out


def _tree_entries(out: bytes) -> list[tuple[int, str, bytes]]:
    entries = []
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, _, path = rec.partition(b"\t")
        mode, _kind, oid = meta.split(b" ")
        entries.append((int(mode, 8), oid.decode(), path))
    return entries


def write_workspace(
    shadow: ShadowGit, tree: str, workspace: Path, *, fmt: str, source: RepoDir | None = None,
    listing: bytes | None = None,
) -> Checkout:  # fmt: skip
    """Write the base tree's exact bytes into ``workspace`` (clones from ``source`` if possible).

    ``listing`` is the tree's :func:`tree_listing` if the caller has it already.
    """
    entries = _tree_entries(tree_listing(shadow, tree) if listing is None else listing)
    done = Checkout(modes={os.fsdecode(p): m for m, _oid, p in entries})
    with SafeWriter(workspace, max_file_size=1 << 62, max_total_size=1 << 62) as writer:
        for mode, _oid, path in entries:
            if mode == _SUBMODULE:  # an empty directory, as git checks out
                writer.mkdir(path)
        blobs = [(m, oid, p) for m, oid, p in entries if m != _SUBMODULE]
        if source is not None:
            blobs = _clone_from(source, writer, blobs, fmt, done)
        for (mode, _oid, path), data in zip(blobs, _cat_blobs(shadow, blobs), strict=True):
            if mode == _LINK:
                writer.symlink(path, data)
            else:
                writer.write_file(path, data, mode=0o755 if mode == 0o100755 else 0o644)
                done.written += 1
    return done


def _clone_from(
    source: RepoDir, writer: SafeWriter, blobs: list[tuple[int, str, bytes]], fmt: str,
    done: Checkout,
) -> list[tuple[int, str, bytes]]:  # fmt: skip
    """Clone what can be cloned from the user's work tree; return the blobs still to write."""
    rest: list[tuple[int, str, bytes]] = []
    cloning = True
    for i, (mode, oid, path) in enumerate(blobs):
        if mode == _LINK or not cloning or not _big(source, path):
            rest.append(blobs[i])
            continue
        try:
            ok = _clone_one(source, writer, mode, oid, path, fmt)
        except OSError as exc:
            if exc.errno not in NO_CLONE:
                raise
            # The filesystem (or the pair) cannot clone: write everything from here on.
            log.info("workspace: no reflink", repo=str(source.path), reason=exc.strerror)
            cloning, ok = False, False
        if ok:
            done.cloned += 1
        else:
            rest.append(blobs[i])
    return rest


def _big(source: RepoDir, path: bytes) -> bool:
    """Is the work tree's ``path`` a file of at least :data:`CLONE_MIN` bytes?

    Only a hint (which files to try): the clone itself opens beneath the repo
    with no link followed, and keeps only what hashes to the base blob.
    """
    try:
        st = os.stat(path, dir_fd=source.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size >= CLONE_MIN


def _clone_one(source: RepoDir, writer: SafeWriter, mode: int, oid: str, path: bytes,
               fmt: str) -> bool:  # fmt: skip
    """Clone ``path`` from the user's work tree if it is exactly blob ``oid``."""
    try:
        # O_PATH: nothing is opened for real until we know it is a regular file.
        pfd = openat2(source.fd, path, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, a link on the way, another filesystem: write it instead
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != source.owner[0]:
            return False
        src = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    finally:
        os.close(pfd)
    try:
        size = writer.clone_file(
            path, src, 0o755 if mode == 0o100755 else 0o644,
            check=lambda fd: _blob_id(fd, fmt) == oid,
        )  # fmt: skip
    finally:
        os.close(src)
    return size is not None


def _blob_id(fd: int, fmt: str) -> str:
    """The git blob id of the file open at ``fd`` (read from offset 0)."""
    size = os.fstat(fd).st_size
    h = hashlib.new(fmt, b"blob %d\0" % size)
    pos = 0
    while chunk := os.pread(fd, 1 << 20, pos):
        h.update(chunk)
        pos += len(chunk)
    if pos != size:  # changed under us: cannot be the blob
        return ""
    return h.hexdigest()


def _cat_blobs(shadow: ShadowGit, blobs: list[tuple[int, str, bytes]]) -> Iterator[bytes]:
    """The content of each blob, in order, from one ``git cat-file --batch`` per 2,000."""
    # Not streamed into memory whole: batches of objects keep memory bounded.
    for start in range(0, len(blobs), 2000):
        yield from _cat_batch(shadow, [oid for _m, oid, _p in blobs[start : start + 2000]])


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


def init_agent_git(
    shadow: ShadowGit, workspace: Path, tree: str, base: str, fmt: str,
    *, tree_pack: Callable[[Path], None] | None = None,
) -> Path:  # fmt: skip
    """Give the workspace a fresh ``.git`` of its own: one root commit of the base tree.

    The commit is written by us into the shadow dir and, loose, into the new
    ``.git`` (as ``git init`` makes it, :func:`~agentbox.collect._git.init_repo`)
    with its ref ``main``; the tree's objects go over as one pack: either
    ``tree_pack(pack_dir)`` puts a cached copy there, or ``pack-objects`` (run
    in the shadow dir) writes it straight into it. Returns that pack's path
    without extension. Its index is not written here:
    :func:`~agentbox.collect._prepare.prepare` copies the base index it reads
    anyway (the same ``read-tree`` of the same tree).
    """
    msg = f"agentbox: workspace base (from {base[:12]})\n"
    when = int(time.time())
    root = write_commit(BlobWriter(shadow.git_dir, fmt), tree, None, msg, when=when)
    write_ref(shadow.git_dir, "refs/agentbox/workspace", root)
    agent_git = workspace / ".git"
    user = "[user]\n\tname = agentbox agent\n\temail = agent@agentbox.invalid\n"
    try:
        init_repo(agent_git, fmt, head="main", bare=False, extra_config=user)
    except FileExistsError as exc:  # the base tree itself has a .git entry
        raise CollectError(f"the base tree has a .git entry: {agent_git} exists") from exc
    pack_dir = agent_git / "objects" / "pack"
    if tree_pack is not None:
        tree_pack(pack_dir)
        names = [p.stem for p in pack_dir.glob("pack-*.idx")]
        name = names[0] if len(names) == 1 else ""
    else:
        # Every object of the base tree (the shadow holds them all: they came with
        # the fetch), as the pack a fetch would have stored.
        made = shadow.run("pack-objects", "--revs", "--quiet", "--delta-base-offset",
                          pack_dir / "pack", input=f"{tree}\n")  # fmt: skip
        name = "pack-" + made.stdout.strip()
    if not name or not (pack_dir / (name + ".idx")).is_file():
        raise CollectError(f"no pack of the base tree in {agent_git}")
    # The same commit, byte for byte (same time stamp), loose beside the pack.
    write_commit(BlobWriter(agent_git, fmt), tree, None, msg, when=when)
    write_ref(agent_git, "refs/heads/main", root)
    return pack_dir / name


def chown_tree(root: Path, uid: int, gid: int) -> None:
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
