"""``Sandbox.fork(n)``: n sandboxes that start from a live sandbox's files.

A sandbox's root is read-only, so what it has made lives in its workspace (a host
directory bound at ``/workspace`` on podman and docker) and in its tmpfs
(``/tmp``, ``$HOME``). A fork is a new sandbox of the same Boxfile (the same
image and hardening, its own uid slot, owner, holders and deadline) whose
workspace starts as a copy of the parent's and whose tmpfs is refilled from the
parent's:

* **the workspace, podman and docker**: the parent is paused (``podman pause``:
  the cgroup freezer; nothing in it runs, so its tree cannot change under the copy,
  and the copy is consistent), then copied on the host with ``cp -a
  --reflink=auto`` (links copied as links; copy-on-write where the filesystem
  shares extents: btrfs, XFS; a plain copy elsewhere), run as the *parent's*
  sandbox uid, so it reads nothing the parent could not, into the fork's fresh
  workspace before its sandbox starts; then every entry is handed to the fork's
  uid (``lchown``, no link followed; no sandbox can see that directory yet). A
  parent that cannot be paused is copied as a microVM's is (below);
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
from collections.abc import Iterator
from pathlib import Path

from agentbox.backends.base import Sandbox
from agentbox.core.proc import run
from agentbox.errors import CommandError, RefusedError, SandboxError
from agentbox.launcher.boxapi import MAX_ARCHIVE

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
