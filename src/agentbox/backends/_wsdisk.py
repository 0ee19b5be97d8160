"""The podman sandbox's disk limit: its workspace on a sparse ext4 image, loop-mounted for its life.

A container's ``/workspace`` is a bind mount of a host directory, so without
more the agent writes to the host's disk without bound (5 GB with
``fallocate``, 200k files, in seconds). The data dir here is an ext4 without
project quotas, so every sandbox with a workspace gets its own filesystem:

1. an fd is opened on the workspace directory (it keeps the directory under
   the mount reachable), and ``mkfs.ext4 -d`` copies it into a fresh sparse
   image of the sandbox's disk limit (:meth:`Resources.disk_limit`: bytes and
   inodes), the very function that makes the microVM's ``/data`` disk
   (:func:`agentbox.backends.microvm._disks.make_data_disk`);
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
   Then the disk is taken out of the mount tree (``umount2(MNT_DETACH)`` while an fd
   on its root is held: the workspace is a plain directory again at once) and the
   image deleted; the filesystem's end (its sync, the loop device's release, the
   image's blocks freed) comes with that fd's close, on a thread of its own, off
   the task's path (:func:`wait_released` waits for it). A settler killed before the
   close leaves no mount and no loop device: the fd dies with it.
   (The copy is :mod:`agentbox.backends._wsdisk_copy`.)

A write past the limit fails inside the sandbox with ENOSPC; the copy back
holds at most what the image held, so collection afterwards sees the agent's
partial work. The image is written only by the host kernel's ext4 (the agent
reaches it through the filesystem, never as a block device), so mounting it
is not mounting a guest-made filesystem. The image and a small record live in
``data_dir/disks`` (0700); a launcher that died with a disk mounted leaves the
record, and :func:`settle_orphan_disks` copies back and unmounts it on the next
start.

A detached sandbox's disk outlives the process that mounted it
(:meth:`WorkspaceDisk.hand_over`): its record then names the sandbox's conmon as
owner, so the disk is settled (by the follower, or any settle) only once conmon
is gone, which is once the sandbox has exited; the mount-time snapshot is saved
next to the record so that the copy back in another process costs only what the
agent changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from agentbox.backends._wsdisk_copy import (
    copy_back,
    load_snapshot,
    save_snapshot,
    snapshot,
)
from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm import make_data_disk as make_data_disk  # lent to the pool
from agentbox.backends.oci._cli import owner_start
from agentbox.boxfile import DiskLimit
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError, UnsupportedError
from agentbox.linux.libc import libc as load_libc
from agentbox.linux.loopdev import loop_mount
from agentbox.linux.mounts import (
    MS_NOATIME,
    MS_NODEV,
    MS_NOSUID,
    mount_source,
    umount,
    umount_lazy,
)

log = get_logger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PATH_MAX = 4096


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

    def __init__(
        self,
        settings: Settings,
        name: str,
        workspace: Path,
        limit: DiskLimit,
        *,
        detached: bool = False,
    ) -> None:
        self.workspace = workspace
        #: A detached sandbox's disk: never settled while its container exists.
        self.detached = detached
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
        self._write_record()
        make_data_disk(
            Path(here), self.image, size=self.limit.size, inodes=self.limit.inodes, pad=False
        )
        self.image.chmod(0o600)
        try:  # what `mount -t ext4 -o loop,nosuid,nodev,noatime` does, without its process
            loop_mount(self.image, Path(here), "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
        except OSError as exc:
            raise SandboxError(
                f"cannot mount the workspace disk: {exc}", sandbox=self.name
            ) from exc
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

    def _write_record(self) -> None:
        """This process's record of the disk (its owner, until :meth:`hand_over`), made
        new (a record already there is refused): from here a death leaves what
        :func:`settle_orphan_disks` finds, and the image and record are ours to delete."""
        rec = {"workspace": str(self.workspace), "pid": os.getpid(), "start": owner_start()}
        if self.detached:
            rec["detached"] = True
        fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._created = True
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(rec))

    @property
    def name(self) -> str:
        return self.image.stem

    @property
    def snapshot_file(self) -> Path:
        return self.image.with_suffix(".snap")

    def hand_over(self, pid: int, start: str) -> None:
        """Leave the mounted disk to process ``pid`` (started at ``start``, as
        :func:`owner_start` spells it): from now on it is settled once that process is
        gone, by :func:`settle_orphan_disks`, never by :meth:`release` of this object."""
        save_snapshot(self._snap, self.snapshot_file)
        rec = {"workspace": str(self.workspace), "pid": pid, "start": start, "detached": True}
        tmp = self.record.with_suffix(".tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(rec))
        tmp.replace(self.record)
        if self._under is not None:
            os.close(self._under)
            self._under = None
        self._mounted = False
        self._created = False

    def release(self) -> None:
        """Copy the image's content back under the mount, unmount, delete; idempotent.

        If the copy fails the image is kept (unmounted) for ``agentbox prune`` and
        the error raised: the workspace then holds what was copied so far.
        """
        failure: BaseException | None = None
        held: int | None = None
        try:
            if self._mounted and self._under is not None:
                try:
                    copy_back(self.workspace, self._under, self._snap)
                except (OSError, AgentboxError) as exc:
                    failure = exc
                    log.error("copying the workspace disk back failed",
                              image=str(self.image), error=str(exc))  # fmt: skip
                held = _detach(self.workspace)
                self._mounted = False
        finally:
            if self._under is not None:
                os.close(self._under)
                self._under = None
        try:
            if failure is not None:
                raise SandboxError(
                    f"could not copy the workspace back from its disk: {failure}",
                    sandbox=self.name,
                ) from failure
            if self._created:
                self.image.unlink(missing_ok=True)
                self.record.unlink(missing_ok=True)
                self._created = False
        finally:
            if held is not None:
                _close_later(held)


#: Workspaces this process made bounded already (a fork's overlay, whose writable layer
#: is an image of the disk limit: launcher/_fork.py); no disk is mounted over them.
_bounded: set[str] = set()
_bounded_lock = threading.Lock()


def mark_bounded(workspace: Path, bounded: bool = True) -> None:
    """Say that ``workspace`` is bounded by its own layer (or, ``bounded=False``, no more)."""
    with _bounded_lock:
        (_bounded.add if bounded else _bounded.discard)(str(workspace))


@contextlib.contextmanager
def workspace_disk(settings: Settings, spec: SandboxSpec) -> Iterator[WorkspaceDisk | None]:
    """The workspace of ``spec`` on its own disk for the ``with`` block (None: no workspace,
    or one bounded already, see :func:`mark_bounded`)."""
    with _bounded_lock:
        bounded = spec.workspace is not None and str(spec.workspace) in _bounded
    if spec.workspace is None or bounded:
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
    """``umount``, else ``umount --lazy``: by ``umount2`` in this process (an ``umount``
    process was ~3-10 ms of every task's end, on the path to its result)."""
    try:
        umount(path)
    except OSError as exc:
        # Still busy (a process of the sandbox lingering): detach it now; the
        # kernel frees the filesystem and its loop device with the last user.
        log.warning("workspace disk busy; lazy unmount", path=str(path), error=str(exc))
        try:
            umount_lazy(path)
        except OSError as again:
            raise SandboxError(f"cannot unmount the workspace disk: {again}") from again


def _detach(path: Path) -> int | None:
    """Take the disk mounted at ``path`` out of the mount tree now; the filesystem's end
    (ext4's sync and shutdown, the loop device's release, the deleted image's blocks
    freed: 5-30 ms on a busy host) comes later, when the returned fd is closed
    (:func:`_close_later`), off the task's path.

    The fd on the disk's root keeps the filesystem alive past ``umount2(MNT_DETACH)``,
    which then only unhooks the mount: the directory under it is a plain directory again
    at once, and nothing new can reach the disk through the path. The fd dies with this
    process: a settler killed before the close leaves no mount and no loop device, only
    (if it was killed before it deleted them) the image and record a later settle deletes.
    None when no fd could be held: then the unmount is :func:`_umount`'s, whole, here.
    """
    try:
        held = os.open(path, _DIR_FLAGS)
    except OSError:
        _umount(path)
        return None
    try:
        umount_lazy(path)
    except OSError as exc:
        os.close(held)
        raise SandboxError(f"cannot unmount the workspace disk: {exc}") from exc
    return held


_closers: list[threading.Thread] = []
_closers_lock = threading.Lock()


def _close_later(fd: int) -> None:
    """Close ``fd`` (a detached disk's last user, see :func:`_detach`) on a thread of its
    own; :func:`wait_released` waits for every such close of this process."""
    thread = threading.Thread(target=os.close, args=(fd,), name="agentbox-disk-end", daemon=True)
    with _closers_lock:
        _closers[:] = [t for t in _closers if t.is_alive()]
        _closers.append(thread)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had (interpreter shutting down): close here
        os.close(fd)


def wait_released(timeout: float = 60.0) -> bool:
    """Wait until every workspace disk this process detached is released (its filesystem
    shut down, its loop device free): True if all were within ``timeout`` seconds."""
    with _closers_lock:
        pending = list(_closers)
    end = time.monotonic() + timeout
    for thread in pending:
        thread.join(max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in pending)


def settle_orphan_disks(
    settings: Settings, name: str | None = None, *, exited: bool = False, ended: bool = False
) -> list[str]:
    """Copy back and unmount workspace disks whose owner process is gone (only sandbox
    ``name``'s, if given); return their sandbox names.

    ``exited``: the caller knows sandbox ``name`` has exited (its follower saw the end
    and its conmon gone), so its container need not be removed first. ``ended``: more
    than that, the caller read the runtime's record of the end (conmon's exit file,
    written once the sandbox's init, and so every process of its pid namespace, is
    gone): the disk is settled while its owner (conmon, running podman's cleanup) runs.

    Call it once the sandbox's container is gone. One settler at a time per data dir
    (:func:`_settling`); the directory under the mount is reached through a detached
    copy of its parent's mount, which dies with the settler (:func:`_settle_one`).
    """
    base = settings.data_dir / "disks"
    if not base.is_dir():
        return []
    with _settling(base):
        one = name is not None
        return _settle_records(base, name, exited=(exited or ended) and one, ended=ended and one)


def disk_left(settings: Settings, name: str) -> bool:
    """Whether sandbox ``name`` still has a workspace disk recorded (not settled yet)."""
    return (disks_dir(settings) / f"{name}.json").is_file()


def _settle_records(
    base: Path, name: str | None, *, exited: bool = False, ended: bool = False
) -> list[str]:
    settled = []
    pattern = "*.json" if name is None else f"{name}.json"
    for rec_path in sorted(base.glob(pattern)):
        try:
            rec = json.loads(rec_path.read_text())
            ws, pid, start = Path(rec["workspace"]), int(rec["pid"]), str(rec["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid, start) and not ended:
            continue
        if rec.get("detached") is True and not exited and _container_exists(rec_path.stem):
            # Its container runs on without the process that mounted the disk (a launcher
            # that died between the mount and the hand-over): its follower, or a reap,
            # settles it once the container is removed.
            continue
        image = rec_path.with_suffix(".img")
        snap = load_snapshot(rec_path.with_suffix(".snap"))
        held = None
        try:
            if _mounted_from(ws, image):
                held = _settle_one(base, ws, snap)
        except (OSError, AgentboxError) as exc:
            log.error("could not settle an orphan workspace disk", image=str(image), error=str(exc))
            continue
        try:
            # Deleted while the detached disk still holds the image open: only its name
            # goes here; its blocks are freed with the loop device, at the close.
            image.unlink(missing_ok=True)
            rec_path.with_suffix(".snap").unlink(missing_ok=True)
            rec_path.unlink(missing_ok=True)
        finally:
            if held is not None:
                _close_later(held)
        settled.append(rec_path.stem)
    return settled


def _alive(pid: int, start: str) -> bool:
    """Whether the record's owner still runs. A zombie does not: it died, and its
    parent has not reaped it yet (a reaper acting the moment it died sees one)."""
    import psutil

    if pid <= 0:  # a detached sandbox whose conmon was gone before it was recorded
        return False
    try:
        proc = psutil.Process(pid)
        return f"{proc.create_time():.0f}" == start and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _container_exists(name: str) -> bool:
    """Whether podman, or docker (a detached docker sandbox's disk too), has ``name``."""
    res = _proc.run(["podman", "container", "exists", name], check=False, timeout=60)
    if res.returncode == 0:
        return True
    if not Path("/var/run/docker.sock").exists() or shutil.which("docker") is None:
        return False
    res = _proc.run(["docker", "container", "inspect", "--format", "{{.Id}}", name],
                    check=False, timeout=60)  # fmt: skip
    return res.returncode == 0


def _mounted_from(ws: Path, image: Path) -> bool:
    """Whether the topmost mount at ``ws`` is a loop device backed by ``image``: what
    ``findmnt -o SOURCE --mountpoint`` and ``losetup -O BACK-FILE`` say, read from
    ``/proc/self/mountinfo`` and the loop device's sysfs (two processes were ~5-25 ms of
    every task's end)."""
    if not os.path.ismount(ws):
        return False
    src = mount_source(Path(os.path.realpath(ws)))
    name = src.removeprefix("/dev/")
    if not src.startswith("/dev/loop") or not name[4:].isdigit():
        return False
    try:
        with open(f"/sys/block/{name}/loop/backing_file", "rb") as fh:
            back = os.fsdecode(fh.read(PATH_MAX + 16).rstrip(b"\n"))
    except OSError:
        return False
    return back.removesuffix(" (deleted)") == str(image)


def _settle_one(base: Path, ws: Path, snap: dict[str, tuple[int, int]]) -> int | None:
    """Copy the disk at ``ws`` back into the directory under it, then take it out of the
    mount tree (:func:`_detach`: the returned fd, if any, is its last user; close it).

    The directory under the mount is reached through a detached, non-recursive copy
    of the mount holding ``ws.parent`` (``open_tree``): it is in no mount table, so a
    settler killed in the middle leaves no mount behind (a bind mount did, one per
    kill), and no mount made elsewhere propagates into a path the copy walks.
    """
    tree = _detached_tree(ws.parent, base)
    try:
        under = os.open(ws.name, _DIR_FLAGS, dir_fd=tree)
        try:
            if os.fstat(under).st_dev == ws.stat().st_dev:
                raise SandboxError(f"the directory under the disk at {ws} is the disk itself")
            copy_back(ws, under, snap)
        finally:
            os.close(under)
    finally:
        os.close(tree)
    return _detach(ws)


_SYS_OPEN_TREE = 428  # the same number on every architecture (asm-generic, Linux 5.2)
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100


def _detached_tree(path: Path, base: Path) -> int:
    """An fd on ``path`` in a detached copy of the mount holding it, without the
    mounts below it; the copy is unmounted when its last fd closes (or its process dies).

    Where ``open_tree`` is missing (Linux before 5.2, or refused by a seccomp filter)
    the same comes of a private bind mount under ``base`` that is opened and at once
    detached (``umount --lazy``): only that moment leaves a mount to a killed settler
    (which :func:`_settling` removes).
    """
    libc = load_libc()
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC
    fd = int(libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(path), flags))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EPERM):
        raise SandboxError(f"open_tree({path}) failed: {os.strerror(err)}")
    peek = base / f".settle-{os.getpid()}-{threading.get_ident()}"
    peek.mkdir(mode=0o700)
    try:
        _proc.run(["mount", "--bind", path, peek], timeout=60)
        try:
            _proc.run(["mount", "--make-private", peek], timeout=60)
            fd = os.open(peek, _DIR_FLAGS)
        finally:
            _proc.run(["umount", "--lazy", peek], timeout=60)
    finally:
        peek.rmdir()
    return fd


@contextlib.contextmanager
def _settling(base: Path) -> Iterator[None]:
    """One settler at a time per data dir (a follower, an adopter, a reap and a start-up
    sweep may each reach the same disk): an ``flock`` on ``disks/``, released by the
    kernel if the holder dies. Mounts a killed settler left (``disks/.settle-*``)
    are removed under it."""
    fd = os.open(base, _DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for stale in base.glob(".settle-*"):
            with contextlib.suppress(OSError, AgentboxError):
                if os.path.ismount(stale):
                    _proc.run(["umount", "--lazy", stale], timeout=60)
                stale.rmdir()
                log.warning("removed a stale settle mount", path=str(stale))
        yield
    finally:
        os.close(fd)
