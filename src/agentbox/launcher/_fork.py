"""``Sandbox.fork(n)``: n sandboxes that start from a live sandbox's files.

A sandbox's root is read-only, so what it has made lives in its workspace (a host
directory bound at ``/workspace`` on podman and docker) and in its tmpfs
(``/tmp``, ``$HOME``). A fork is a new sandbox of the same Boxfile (the same
image and hardening, its own uid slot, owner, holders and deadline) whose
workspace starts as a copy of the parent's and whose tmpfs is refilled from the
parent's:

* **the workspace, podman and docker**: the parent is paused (``podman pause``:
  the cgroup freezer; nothing in it runs, so its tree cannot change under the copy,
  and the copy is consistent), then copied once on the host with ``cp -a
  --reflink=auto`` (links copied as links; extents shared where the filesystem
  can: btrfs, XFS; a plain copy elsewhere), run as the *parent's* sandbox uid, so
  it reads nothing the parent could not. That copy is the read-only lower layer of
  every fork's workspace (:class:`Lower`, removed with the last fork): each fork's
  workspace is a kernel overlay of it (:func:`overlay_workspace`, the mount an
  environment gets, :class:`~agentbox.env.EnvMount`) whose writable layer
  lies on an ext4 image of the fork's disk limit, loop-mounted on the host, so a
  fork's writes are bounded as a podman workspace disk bounds them (that disk is
  then not mounted: :func:`~agentbox.backends.mark_bounded`). Every entry
  is handed to the fork's uid in the fork's view (``lchown`` with ``metacopy=on``:
  only metadata is copied up, never a file's data; no sandbox sees it yet). The
  overlay and its image are unmounted and deleted after the fork's sandbox is gone.
  A parent that cannot be paused is copied as other backends' are (below);
* **the workspace, other backends**: packed inside the parent by its own uid and
  unpacked inside the fork by its own, as an upload is (bounded by
  :data:`~agentbox.launcher.boxapi.MAX_ARCHIVE`; no memory state);
* **the tmpfs**: the same, inside.

On those, what runs in the parent (processes, memory, open files) is not carried
over, and files the parent writes while the copy runs may be half there.

**qemu** forks are not made here: its backend saves the live VM whole (memory,
processes, tmpfs, ``/data`` copy-on-write) and restores each fork from that
(:mod:`agentbox.backends.microvm._fork`; ``BoxKeeper._fork_vm``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from agentbox.backends.base import Sandbox
from agentbox.boxfile import DiskLimit
from agentbox.core.log import get_logger
from agentbox.core.proc import run
from agentbox.errors import CommandError, RefusedError, SandboxError
from agentbox.launcher.boxapi import MAX_ARCHIVE

log = get_logger(__name__)

#: The tmpfs trees a fork takes from its parent (relative to ``/``).
TMPFS_PARTS = ("tmp", "home/agent")
#: Left out: the keeper's own pid files of background commands.
_SKIP = "./tmp/.agentbox-exec"


@contextlib.contextmanager
def paused(box: Sandbox) -> Iterator[None]:
    """Sandbox ``box`` frozen for the block, by its OCI engine's CLI (``<engine> pause``);
    :class:`SandboxError` when it has no engine or cannot be paused."""
    cli = getattr(box, "engine", None)  # an OCI sandbox names its engine (podman, docker)
    name = box.name
    if not isinstance(cli, str):
        raise SandboxError("fork: this sandbox cannot be paused", sandbox=name)
    try:
        run([cli, "pause", name], timeout=60)
    except CommandError as exc:
        raise SandboxError(f"fork: cannot pause: {exc.stderr[-300:]}", sandbox=name) from exc
    try:
        yield
    finally:
        run([cli, "unpause", name], timeout=60, check=False)


def host_copy(src: Path, dst: Path, *, src_uid: int, dst_uid: int) -> None:
    """Copy the workspace ``src`` into the empty directory ``dst`` (both in one parent
    directory) as ``src_uid``, then give ``dst`` and everything in it to ``dst_uid``."""
    if src.parent != dst.parent:
        raise SandboxError(f"fork: {src} and {dst} are not in one directory")
    os.chown(dst, src_uid, src_uid, follow_symlinks=False)
    argv = ["setpriv", f"--reuid={src_uid}", f"--regid={src_uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--",
            "cp", "-a", "--reflink=auto", "-T", f"{src.name}/.", dst.name]  # fmt: skip
    try:
        # From the common parent: the copier never walks the (root-only) dirs above it.
        run(argv, cwd=src.parent, timeout=1800)
    except CommandError as exc:
        raise SandboxError(f"fork: copying the workspace failed: {exc.stderr[-500:]}") from exc
    for root, dirs, files in os.walk(dst):  # os.walk never follows a link to a directory
        for name in dirs + files:
            os.lchown(Path(root) / name, dst_uid, dst_uid)
    os.chown(dst, dst_uid, dst_uid, follow_symlinks=False)


class Lower:
    """The frozen copy of a parent's workspace that forks' overlays read: removed once
    the last user lets go (:meth:`hold` per fork, :meth:`drop` from each, and once
    from its maker)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._users = 1  # its maker's
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._users += 1

    def drop(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            shutil.rmtree(self.path, ignore_errors=True)


def overlay_workspace(
    lower: Lower, ws: Path, *, uid: int, limit: DiskLimit, stack: contextlib.ExitStack
) -> Path:
    """A fork's workspace: an overlay of ``lower`` in a new dir beside ``ws`` whose
    writable layer is an image of ``limit``, every entry ``uid``'s in it; returns the
    merged dir. ``stack`` unmounts and deletes it all (and lets go of ``lower``)."""
    from agentbox.backends import mark_bounded
    from agentbox.env import EnvMount, walk_tree

    em = EnvMount(lower.path, ws.parent / f"{ws.name}{LAYER_SUFFIX}")
    lower.hold()
    stack.callback(lower.drop)
    stack.callback(em.release)
    em.mount(ws, [], uid, limit=limit)
    merged = em.merged
    for path in [merged, *walk_tree(merged)]:  # metacopy: metadata copied up, never data
        st = path.lstat()
        if st.st_uid != uid:
            os.chown(path, uid, uid if st.st_gid != 0 else 0, follow_symlinks=False)
    mark_bounded(merged)
    stack.callback(mark_bounded, merged, False)
    log.info("fork workspace: an overlay of the parent's", workspace=str(merged))
    return merged


#: How a fork's workspace dir is named beside its scratch workspace.
LAYER_SUFFIX = ".fork"


def settle_fork_layers(scratch: Path) -> list[str]:
    """Unmount and delete the fork workspaces a launcher that died left in ``scratch``
    (call before this launcher makes any); their lowers are plain scratch dirs, pruned
    as those are. Returns the dirs settled."""
    from agentbox.env import EnvMount

    settled = []
    with contextlib.suppress(OSError):
        for d in sorted(scratch.glob(f"*{LAYER_SUFFIX}")):
            if d.is_dir() and not d.is_symlink():
                EnvMount(Path("/nonexistent"), d).release()  # busy: unmounted lazily
                settled.append(d.name)
    if settled:
        log.warning("settled fork workspaces of a launcher that died", dirs=settled[:20])
    return settled


def pack_inside(box: Sandbox, parts: tuple[str, ...], *, under: str = "/") -> bytes:
    """A tar of ``parts`` under ``under``, made inside ``box`` by its own uid (what it
    cannot read is left out), at most :data:`MAX_ARCHIVE` bytes."""
    names = " ".join(f"./{p}" for p in parts)
    # What is *in* each part, not the part itself: /tmp, $HOME and /workspace are not the
    # sandbox's to chmod, and the fork's already exist.
    script = (f'cd "$0" && {{ find {names} -mindepth 1 -maxdepth 1 ! -path {_SKIP} -print0 '
              f'2>/dev/null | tar -cf - --null -T - --ignore-failed-read 2>/dev/null; true; }} '
              f'| head -c {MAX_ARCHIVE + 1}')  # fmt: skip
    res = box.exec(["sh", "-c", script, under], timeout=600)
    if res.exit_code != 0:
        raise SandboxError(f"fork: packing {under} failed: {res.stderr.decode(errors='replace')}")
    if len(res.stdout) > MAX_ARCHIVE:
        raise RefusedError(f"fork: {', '.join(parts)} hold more than {MAX_ARCHIVE} bytes")
    return res.stdout


def unpack_inside(box: Sandbox, data: bytes, *, under: str = "/") -> None:
    """Unpack ``data`` (from :func:`pack_inside`) under ``under``, inside ``box`` as its uid."""
    if not data:
        return
    script = 'exec tar -x --no-same-owner -C "$0" -f -'
    res = box.exec(["sh", "-c", script, under], stdin=data, timeout=600)
    if res.exit_code != 0:
        err = res.stderr.decode(errors="replace")[-500:]
        raise SandboxError(f"fork: unpacking into {under} failed: {err}")
