"""The podman sandbox's disk limit: its workspace on a sparse ext4 image, loop-mounted for its life.

A container's ``/workspace`` is a bind mount of a host directory, so without
more the agent writes to the host's disk without bound (issue 11: 5 GB with
``fallocate``, 200k files, in seconds). The data dir here is an ext4 without
project quotas, so every sandbox with a workspace gets its own filesystem:

1. an fd is opened on the workspace directory (it keeps the directory under
   the mount reachable), and ``mkfs.ext4 -d`` copies it into a fresh sparse
   image of the sandbox's disk limit (:meth:`Resources.disk_limit`: bytes and
   inodes), the very function that makes the microVM's ``/data`` disk
   (:func:`agentbox.microvm._disks.make_data_disk`);
2. the image is loop-mounted ``nosuid,nodev`` *over* the workspace directory
   (through ``/proc/<pid>/fd/<fd>``: the path is not looked up again), with the
   directory's owner and mode; the container bind-mounts that path as usual;
3. when the container is gone, the directory under the mount is made to hold
   what the image holds, by directory fds, never following a link: entries
   whose inode and ctime on the disk are what they were at mount (a snapshot
   taken before the sandbox started; ctime cannot be set from userspace) are
   left as they are, so the copy costs what the agent changed and collection's
   stat cache stays valid; the rest is removed or copied as the agent left it
   (regular files sparse, hard links as links, symlinks as symlinks, FIFOs and
   sockets as such, modes with their setuid/setgid bits: collection, the
   trusted reader, skips and reports those as it did when the workspace was a
   plain bind mount; device nodes, which the sandbox cannot make, are skipped).
   Then the image is unmounted (the loop device is freed with it) and deleted.

A write past the limit fails inside the sandbox with ENOSPC; the copy back
holds at most what the image held, so collection afterwards sees the agent's
partial work. The image is written only by the host kernel's ext4 (the agent
reaches it through the filesystem, never as a block device), so mounting it
is not mounting a guest-made filesystem. The image and a small record live in
``data_dir/disks`` (0700); a launcher that died with a disk mounted leaves the
record, and :func:`settle_orphan_disks` copies back and unmounts it on the next
start.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from agentbox import _proc
from agentbox._log import get_logger
from agentbox.backends._podman_util import owner_start
from agentbox.backends.base import SandboxSpec
from agentbox.boxfile import DiskLimit
from agentbox.config import Settings
from agentbox.errors import AgentboxError, SandboxError, UnsupportedError
from agentbox.microvm._disks import make_data_disk

__all__ = ["MAX_COPY_DEPTH", "WorkspaceDisk", "disks_dir", "settle_orphan_disks", "workspace_disk"]

log = get_logger("podman.disk")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Directories nested deeper than this are not copied back (each level holds two fds).
MAX_COPY_DEPTH = 128
_CHUNK = 1 << 20


def disks_dir(settings: Settings) -> Path:
    """Where workspace images and their records live (root's, 0700)."""
    d = settings.data_dir / "disks"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"{d} is not a directory (a link?)")
    return d


class WorkspaceDisk:
    """One sandbox's workspace image: :meth:`mount` before the container, :meth:`release` after."""

    def __init__(self, settings: Settings, name: str, workspace: Path, limit: DiskLimit) -> None:
        self.workspace = workspace
        self.limit = limit
        base = disks_dir(settings)
        self.image = base / f"{name}.img"
        self.record = base / f"{name}.json"
        self._under: int | None = None
        self._mounted = False
        self._created = False  # the image and record are ours to delete
        self._snap: dict[str, tuple[int, int]] = {}

    def mount(self) -> None:
        """Copy the workspace into a fresh image and mount it over the workspace."""
        if os.geteuid() != 0:
            raise UnsupportedError(
                "a podman workspace's disk limit is a loop mount, which needs root",
                fix="run agentbox as root (as the launcher does)",
            )
        if self.image.exists() or self.record.exists():
            raise SandboxError(f"a workspace disk {self.image} already exists", sandbox=self.name)
        if os.path.ismount(self.workspace):
            # Another sandbox's disk (or a mount of the user's): stacking a second
            # disk on it would copy one sandbox's work into the other's.
            raise SandboxError(
                f"the workspace {self.workspace} is a mount point (in use by another sandbox?)",
                sandbox=self.name,
            )
        under = os.open(self.workspace, _DIR_FLAGS)
        self._under = under
        st = os.fstat(under)
        here = f"/proc/{os.getpid()}/fd/{under}"
        rec = {"workspace": str(self.workspace), "pid": os.getpid(), "start": owner_start()}
        fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._created = True
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(rec))
        make_data_disk(
            Path(here), self.image, size=self.limit.size, inodes=self.limit.inodes, pad=False
        )
        self.image.chmod(0o600)
        _proc.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", self.image, here])
        self._mounted = True
        top = os.open(self.workspace, _DIR_FLAGS)
        try:
            if os.fstat(top).st_dev == st.st_dev:
                raise SandboxError("the workspace disk did not mount", sandbox=self.name)
            os.fchown(top, st.st_uid, st.st_gid)
            os.fchmod(top, stat.S_IMODE(st.st_mode))
            with contextlib.suppress(OSError):  # mkfs made it; the copy had none
                os.rmdir("lost+found", dir_fd=top)
        finally:
            os.close(top)
        self._snap = snapshot(self.workspace)
        log.info("workspace disk mounted", workspace=str(self.workspace),
                 bytes=self.limit.size, inodes=self.limit.inodes)  # fmt: skip

    @property
    def name(self) -> str:
        return self.image.stem

    def release(self) -> None:
        """Copy the image's content back under the mount, unmount, delete; idempotent.

        If the copy fails the image is kept (unmounted) for ``agentbox prune`` and
        the error raised: the workspace then holds what was copied so far.
        """
        failure: BaseException | None = None
        try:
            if self._mounted and self._under is not None:
                try:
                    _copy_back(self.workspace, self._under, self._snap)
                except (OSError, AgentboxError) as exc:
                    failure = exc
                    log.error("copying the workspace disk back failed",
                              image=str(self.image), error=str(exc))  # fmt: skip
                _umount(self.workspace)
                self._mounted = False
        finally:
            if self._under is not None:
                os.close(self._under)
                self._under = None
        if failure is not None:
            raise SandboxError(
                f"could not copy the workspace back from its disk: {failure}", sandbox=self.name
            ) from failure
        if self._created:
            self.image.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)
            self._created = False


@contextlib.contextmanager
def workspace_disk(settings: Settings, spec: SandboxSpec) -> Iterator[WorkspaceDisk | None]:
    """The workspace of ``spec`` on its own disk for the ``with`` block (None: no workspace)."""
    if spec.workspace is None:
        yield None
        return
    disk = WorkspaceDisk(settings, spec.name, spec.workspace, spec.resources.disk_limit(settings))
    try:
        disk.mount()
    except BaseException:
        with contextlib.suppress(AgentboxError, OSError):
            disk.release()
        raise
    try:
        yield disk
    finally:
        disk.release()


def _umount(path: Path) -> None:
    try:
        _proc.run(["umount", path], timeout=60)
    except AgentboxError as exc:
        # Still busy (a process of the sandbox lingering): detach it now; the
        # kernel frees the filesystem and its loop device with the last user.
        log.warning("workspace disk busy; lazy unmount", path=str(path), error=str(exc))
        _proc.run(["umount", "--lazy", path], timeout=60)


def settle_orphan_disks(settings: Settings, name: str | None = None) -> list[str]:
    """Copy back and unmount workspace disks whose owner process is gone (only sandbox
    ``name``'s, if given); return their sandbox names.

    Call it once the sandbox's container is gone. The directory under the mount is
    reached through a non-recursive bind mount of its parent (which does not carry
    the disk's mount).
    """
    base = settings.data_dir / "disks"
    if not base.is_dir():
        return []
    settled = []
    pattern = "*.json" if name is None else f"{name}.json"
    for rec_path in sorted(base.glob(pattern)):
        try:
            rec = json.loads(rec_path.read_text())
            ws, pid, start = Path(rec["workspace"]), int(rec["pid"]), str(rec["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid, start):
            continue
        image = rec_path.with_suffix(".img")
        try:
            if _mounted_from(ws, image):
                _settle_one(base, ws)
        except (OSError, AgentboxError) as exc:
            log.error("could not settle an orphan workspace disk", image=str(image), error=str(exc))
            continue
        image.unlink(missing_ok=True)
        rec_path.unlink(missing_ok=True)
        settled.append(rec_path.stem)
    return settled


def _alive(pid: int, start: str) -> bool:
    """Whether the record's owner still runs. A zombie does not: it died, and its
    parent has not reaped it yet (a reaper acting the moment it died sees one)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return f"{proc.create_time():.0f}" == start and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _mounted_from(ws: Path, image: Path) -> bool:
    if not os.path.ismount(ws):
        return False
    res = _proc.run(["findmnt", "-n", "-o", "SOURCE", "--mountpoint", ws], check=False, timeout=30)
    src = res.stdout.strip()
    if not src.startswith("/dev/loop"):
        return False
    back = _proc.run(["losetup", "-n", "-O", "BACK-FILE", src], check=False, timeout=30)
    return back.stdout.strip().removesuffix(" (deleted)") == str(image)


def _settle_one(base: Path, ws: Path) -> None:
    peek = base / f".settle-{secrets.token_hex(4)}"
    peek.mkdir(mode=0o700)
    try:
        _proc.run(["mount", "--bind", ws.parent, peek], timeout=60)
        try:
            under = os.open(peek / ws.name, _DIR_FLAGS)
            try:
                _copy_back(ws, under)
            finally:
                os.close(under)
        finally:
            _proc.run(["umount", peek], timeout=60)
        _umount(ws)
    finally:
        peek.rmdir()


# -- the copy back


#: Entries the mount-time snapshot records at most (bounded by the prepared workspace,
#: not by the agent; past it, files are copied back whether changed or not).
MAX_SNAPSHOT = 1_000_000
_Snapshot = dict[str, tuple[int, int]]


def snapshot(mounted: Path) -> _Snapshot:
    """``{relative path: (inode, ctime_ns)}`` of every non-directory on the fresh disk.

    Taken before the sandbox starts. ctime cannot be set from userspace (only by a
    clock change the sandbox cannot make), so an entry whose inode and ctime are
    the same at the end was not touched, and its copy under the mount is kept as
    it is: no copy, and collection's stat cache still knows it.
    """
    snap: _Snapshot = {}
    stack = [""]
    while stack and len(snap) < MAX_SNAPSHOT:
        rel = stack.pop()
        try:
            with os.scandir(mounted / rel if rel else mounted) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            st = e.stat(follow_symlinks=False)
            path = f"{rel}{e.name}"
            if stat.S_ISDIR(st.st_mode):
                stack.append(path + "/")
            else:
                snap[path] = (st.st_ino, st.st_ctime_ns)
    return snap


def _copy_back(mounted: Path, under: int, snap: _Snapshot | None = None) -> None:
    """Make the directory ``under`` hold what ``mounted``'s disk holds (see step 3)."""
    top = os.open(mounted, _DIR_FLAGS)
    try:
        _Sync(under, snap or {}).run(top)
    finally:
        os.close(top)


def _remove(dfd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


class _Sync:
    """Walks the disk and the directory under it side by side, by directory fds."""

    def __init__(self, dst: int, snap: _Snapshot) -> None:
        self.dst = dst
        self.snap = snap
        self.links: dict[int, str] = {}  # inode on the disk → a path (under dst) of its copy
        self.skipped = 0
        self.copied = 0

    def run(self, src: int) -> None:
        # (source dir fd, dest dir fd, relative path, names left, stat to apply at the end)
        stack: list[tuple[int, int, str, Iterator[str], os.stat_result | None]] = []
        stack.append((src, self.dst, "", self._enter(src, self.dst), None))
        try:
            while stack:
                sfd, dfd, rel, names, dir_st = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if dir_st is not None:
                        _set_meta(dfd, "", dir_st, only_changed=True)
                        os.close(sfd)
                        os.close(dfd)
                    continue
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                path = f"{rel}{name}"
                try:
                    old: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    old = None
                if stat.S_ISDIR(st.st_mode):
                    if len(stack) > MAX_COPY_DEPTH:
                        self.skipped += 1
                        continue
                    if old is not None and not stat.S_ISDIR(old.st_mode):
                        _remove(dfd, name)
                        old = None
                    if old is None:
                        os.mkdir(name, 0o700, dir_fd=dfd)
                    child_s = os.open(name, _DIR_FLAGS, dir_fd=sfd)
                    try:
                        child_d = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                    except OSError:
                        os.close(child_s)
                        raise
                    stack.append((child_s, child_d, path + "/", self._enter(child_s, child_d), st))
                    continue
                if (
                    old is not None
                    and self.snap.get(path) == (st.st_ino, st.st_ctime_ns)
                    and stat.S_IFMT(old.st_mode) == stat.S_IFMT(st.st_mode)
                ):
                    continue  # untouched since the disk was made: keep the original
                if old is not None:
                    _remove(dfd, name)
                if stat.S_ISREG(st.st_mode):
                    self._file(sfd, dfd, name, path, st)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                    _set_meta(dfd, name, st)
                elif stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                    # Inert on the host (nothing listens, nothing is read); kept so that
                    # collection reports them, as it did for the plain bind mount.
                    os.mknod(name, stat.S_IFMT(st.st_mode) | 0o600, dir_fd=dfd)
                    _set_meta(dfd, name, st)
                else:
                    self.skipped += 1  # a device node: the sandbox cannot make one
        finally:
            for sfd, dfd, _, _, dir_st in stack:
                if dir_st is not None:
                    os.close(sfd)
                    os.close(dfd)
        if self.skipped:
            log.warning("entries not copied back from a workspace disk", count=self.skipped)

    def _enter(self, sfd: int, dfd: int) -> Iterator[str]:
        """The disk directory's names; what only the directory under it holds goes now."""
        names = list(_names(sfd))
        keep = set(names)
        for gone in _names(dfd):
            if gone not in keep:
                _remove(dfd, gone)
        return iter(names)

    def _file(self, sfd: int, dfd: int, name: str, path: str, st: os.stat_result) -> None:
        self.copied += 1
        first = self.links.get(st.st_ino) if st.st_nlink > 1 else None
        if first is not None:
            try:
                os.link(first, name, src_dir_fd=self.dst, dst_dir_fd=dfd, follow_symlinks=False)
                return
            except OSError as exc:
                if exc.errno not in (errno.EMLINK, errno.ENAMETOOLONG, errno.ENOENT):
                    raise
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fin = os.open(name, flags, dir_fd=sfd)
        try:
            wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fout = os.open(name, wflags, 0o600, dir_fd=dfd)
            try:
                _sparse_copy(fin, fout, st.st_size)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        _set_meta(dfd, name, st)
        if st.st_nlink > 1:
            self.links[st.st_ino] = path


def _names(dir_fd: int) -> Iterator[str]:
    with os.scandir(dir_fd) as it:
        return iter(sorted(e.name for e in it))


def _sparse_copy(fin: int, fout: int, size: int) -> None:
    """Copy only the data extents (a file ``fallocate``d to the limit costs nothing)."""
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fin, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to the end
                break
            raise
        hole = os.lseek(fin, data, os.SEEK_HOLE)
        while data < hole:
            chunk = os.pread(fin, min(_CHUNK, hole - data), data)
            if not chunk:
                break
            os.pwrite(fout, chunk, data)
            data += len(chunk)
        pos = hole
    os.ftruncate(fout, size)


def _set_meta(dfd: int, name: str, st: os.stat_result, *, only_changed: bool = False) -> None:
    """Owner, mode and times of ``st`` onto ``name`` (the owner first: chown clears setuid).

    With ``only_changed`` (directories kept from before), only what differs is set:
    an untouched directory keeps its ctime, and collection's stat cache its entry.
    """
    mode = stat.S_IMODE(st.st_mode)
    if name:
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(name, mode, dir_fd=dfd)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
        return
    cur = os.fstat(dfd)  # the directory dfd itself
    if not only_changed or (cur.st_uid, cur.st_gid) != (st.st_uid, st.st_gid):
        os.fchown(dfd, st.st_uid, st.st_gid)
    if not only_changed or stat.S_IMODE(cur.st_mode) != mode:
        os.fchmod(dfd, mode)
    # Whole seconds: mkfs.ext4 -d copies times without their nanoseconds.
    if not only_changed or int(cur.st_mtime) != int(st.st_mtime):
        os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
