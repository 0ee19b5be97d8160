"""A frozen environment in one task's sandbox: copy-on-write, never a copy.

The launcher (root) mounts a kernel overlay on the host for the task:
``lowerdir`` = the frozen tree (never written), ``upperdir``/``workdir`` in
the task's own directory; then each directory setup created (``.venv``,
``node_modules`` …) is bind-mounted from the overlay into the sandbox at
``/workspace/<dir>``, read-write. The sandbox reads the frozen files in
place and whatever it writes there goes to the task's upper layer, which is
dropped with the task. The workspace itself holds only an empty mount-point
directory for each: the workspace disk image, result collection and the
diff never see the environment's files.

The task's layer is bounded by the task's disk limit (``[resources] disk``,
``inodes``), by the same mechanism as the podman workspace
(:mod:`agentbox.backends._wsdisk`): ``upper``/``work`` live on a sparse
ext4 image of that size, loop-mounted ``nosuid,nodev`` in the task's directory
for the task's life, so a write past it fails inside the sandbox with ENOSPC and
the host's disk is never filled through the environment.

(podman's own ``:O`` overlay volumes fail in a user-namespaced container:
the kernel refuses the overlay mount from inside it, so the overlay is the
host's and the container gets a plain bind mount of it.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from agentbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX, BindMount
from agentbox.boxfile import DiskLimit
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, PathRefused
from agentbox.safepath import check_name, openat2

log = get_logger(__name__)

#: Where setup's ``[setup] keep`` paths are frozen, inside the environment's tree.
KEEP_DIR = ".agentbox-keep"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def make_mountpoint(workspace: Path, rel: str, uid: int) -> bool:
    """An empty directory at ``rel`` beneath ``workspace`` owned by ``uid``, for a bind mount.

    The parent is resolved beneath the workspace with no link followed. False (and
    nothing made) when something other than a directory is already there.
    """
    parts = check_name(rel)
    root = os.open(workspace, _DIR)
    try:
        parent = root
        if len(parts) > 1:
            parent = openat2(root, b"/".join(parts[:-1]), _DIR)
        try:
            name = parts[-1]
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    return False
            os.chown(name, uid, uid, dir_fd=parent, follow_symlinks=False)
            return True
        finally:
            if parent != root:
                os.close(parent)
    except OSError as exc:
        raise PathRefused(f"cannot make the mount point ({exc.strerror})", path=rel) from exc
    finally:
        os.close(root)


def _give_to(merged: Path, uid: int, roots: list[str]) -> None:
    """Give the frozen files under ``roots`` to ``uid`` in this task's view when another
    sandbox uid made them: each sandbox has a host uid range of its own (a uid slot), and
    the task that froze the environment held another. Only the task's layer changes
    (metadata copies); the frozen tree is never written. Root's entries stay root's."""
    for rel in roots:
        top = merged / rel
        try:
            st = top.lstat()
        except OSError:
            continue
        if st.st_uid in (0, uid) or not stat.S_ISDIR(st.st_mode):
            continue  # made by this uid (the same slot), or by none
        for path in [top, *walk_tree(top)]:
            st = path.lstat()
            if st.st_uid not in (0, uid):
                os.chown(path, uid, uid if st.st_gid != 0 else 0, follow_symlinks=False)


def walk_tree(top: Path) -> list[Path]:
    """Every entry below ``top`` (links not followed), ``top`` itself not included."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        out += [Path(dirpath) / n for n in (*dirnames, *filenames)]
    return out


class EnvMount:
    """The overlay of frozen tree ``lower`` for one task, in ``where`` (the task's dir)."""

    def __init__(self, lower: Path, where: Path) -> None:
        self.lower = lower
        self.where = where
        self.merged = where / "merged"
        #: The task's layer (``upper``, ``work``): a loop-mounted image when bounded.
        self.layer = where / "layer"
        self._mounted = False

    def mount(
        self,
        workspace: Path,
        roots: list[str],
        uid: int,
        *,
        keep: list[str] | None = None,
        limit: DiskLimit | None = None,
    ) -> tuple[BindMount, ...]:
        """Mount the overlay and return the sandbox's bind mounts, one per root, and one
        per ``keep`` path (frozen under ``.agentbox-keep``, mounted at ``$HOME/<path>``).

        With ``limit`` the task's layer is an ext4 image of that size (see the module
        docstring). A root whose place in the workspace is taken by a file is skipped
        (logged).
        """
        self.where.mkdir(mode=0o711)
        self.layer.mkdir(mode=0o700)
        if limit is not None:
            from agentbox.backends.microvm._disks import make_data_disk

            image = self.where / "layer.img"
            make_data_disk(None, image, size=limit.size, inodes=limit.inodes, pad=False)
            image.chmod(0o600)
            opts = "loop,nosuid,nodev,noatime"
            _proc.run(["mount", "-t", "ext4", "-o", opts, image, self.layer], timeout=60)
            self._mounted = True
            with contextlib.suppress(OSError):  # mkfs made it
                (self.layer / "lost+found").rmdir()
        upper, work = self.layer / "upper", self.layer / "work"
        for d in (upper, work, self.merged):
            d.mkdir(mode=0o755)
        # metacopy: a chown below copies up only the metadata, never a file's data.
        opts = f"lowerdir={self.lower},upperdir={upper},workdir={work},metacopy=on,nosuid,nodev"
        if any(c in str(self.where) + str(self.lower) for c in ",:\n\0"):
            raise PathRefused("an environment path holds ',' or ':'", path=self.where)
        _proc.run(["mount", "-t", "overlay", "overlay", "-o", opts, self.merged], timeout=60)
        self._mounted = True
        _give_to(self.merged, uid, [*roots, *(f"{KEEP_DIR}/{k}" for k in keep or [])])
        mounts = []
        for rel in keep or []:
            src = self.merged / KEEP_DIR / rel
            if src.exists() and not src.is_symlink():
                mounts.append(BindMount(src, f"{HOME_IN_SANDBOX}/{rel}", read_only=False))
        for rel in roots:
            if rel == KEEP_DIR:
                continue
            if not make_mountpoint(workspace, rel, uid):
                log.warning("environment dir not mounted: a file is in its place", root=rel)
                continue
            src = self.merged / rel
            mounts.append(BindMount(src, f"{WORKSPACE_IN_SANDBOX}/{rel}", read_only=False))
        return tuple(mounts)

    def release(self) -> None:
        """Unmount the overlay and the layer's image (lazily if still busy) and delete the
        task's layer; idempotent."""
        for point in (self.merged, self.layer):
            if not os.path.ismount(point):
                continue
            try:
                _proc.run(["umount", point], timeout=60)
            except AgentboxError as exc:
                log.warning("environment mount busy; lazy unmount", error=str(exc)[:300])
                with contextlib.suppress(AgentboxError):
                    _proc.run(["umount", "--lazy", point], timeout=60)
        self._mounted = False
        if os.path.ismount(self.merged) or os.path.ismount(self.layer):
            log.error("environment overlay still mounted; its layer is kept", path=str(self.merged))
            return
        try:
            shutil.rmtree(self.where)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not remove the task's environment layer", error=str(exc))
