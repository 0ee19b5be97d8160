"""Disk images: the read-only root from an image's root directory, and ``/data``.

Both are ext4 made in userspace with ``mkfs.ext4 -d`` (no loop mount, no
privileges). The root disk is cached by the image's content hash. ``/data``
is always :data:`DATA_DISK_BYTES` (sparse), so a snapshot's guest, which saw
the placeholder's size at boot, sees the same size on every fresh disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from agentbox import _proc
from agentbox.config import Settings
from agentbox.errors import ImageError
from agentbox.microvm._initramfs import ROOT_LABEL

__all__ = ["DATA_DISK_BYTES", "DATA_LABEL", "ensure_root_disk", "make_data_disk", "prune_cache"]

DATA_LABEL = "agentbox-data"
#: Size of every ``/data`` disk (sparse: only what is written takes space).
DATA_DISK_BYTES = 8 * 1024**3
#: Mount points the guest's /init and agent need in the read-only root.
_MOUNT_POINTS = ("workspace", "opt", "opt/agentbox", "opt/agentbox/vm", "home", "home/agent",
                 "tmp", "run", "proc", "sys", "dev")  # fmt: skip
#: Root disks kept in the cache (one per recently used image).
KEEP_ROOT_DISKS = 3
#: Bumped when the disk layout (mount points, mkfs options) changes: old disks are not reused.
LAYOUT = "v2"


def prune_cache(directory: Path, pattern: str, keep: int, *, used: Path | None = None) -> None:
    """Mark ``used`` as just used and delete all but the ``keep`` most recently used matches.

    Running VMs keep what they opened (a bind mount or fd holds the inode), so
    pruning never pulls a file from under a live sandbox.
    """
    if used is not None:
        with contextlib.suppress(OSError):
            os.utime(used)
    entries = []
    for p in directory.glob(pattern):
        with contextlib.suppress(OSError):
            entries.append((p.stat().st_mtime, p))
    for _, p in sorted(entries, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            p.unlink()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                total += (Path(dirpath) / name).lstat().st_blocks * 512
            except OSError:
                continue
    return total


def ensure_root_disk(settings: Settings, rootfs: Path, key: str) -> Path:
    """The read-only root disk of the image whose content hash is ``key``."""
    if not (rootfs / "usr/bin/python3").exists():
        raise ImageError(f"image root {rootfs} has no usr/bin/python3 (the guest agent needs it)")
    out_dir = settings.cache_dir / "microvm" / "disks"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"root-{LAYOUT}-{key[:32]}.img"
    if out.is_file():
        prune_cache(out_dir, "root-*.img", KEEP_ROOT_DISKS, used=out)
        return out
    with (out_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        size_mib = (_tree_bytes(rootfs) * 5 // 4) // 1024**2 + 96
        _proc.run(
            ["mkfs.ext4", "-q", "-F", "-L", ROOT_LABEL, "-O", "^has_journal", "-m", "0",
             "-E", "root_owner=0:0", "-d", rootfs, tmp, f"{size_mib}M"],
            timeout=900,
        )  # fmt: skip
        missing = [p for p in _MOUNT_POINTS if not (rootfs / p).is_dir()]
        if missing:
            cmds = "".join(f"mkdir /{p}\n" for p in missing)
            _proc.run(["debugfs", "-w", "-f", "-", tmp], input=cmds, timeout=120)
        tmp.chmod(0o644)
        tmp.replace(out)
        prune_cache(out_dir, "root-*.img", KEEP_ROOT_DISKS, used=out)
    return out


def make_data_disk(workspace: Path | None, out: Path, *, uid: int = 0) -> Path:
    """A fresh ``/data`` disk at ``out`` holding a copy of ``workspace`` (or empty)."""
    argv: list[str | os.PathLike[str]] = ["mkfs.ext4", "-q", "-F", "-L", DATA_LABEL, "-m", "0"]
    if workspace is not None:
        # Ownership is copied from the host tree; the guest agent re-owns it to
        # the sandbox uid when the root's owner differs.
        argv += ["-d", workspace]
    else:
        argv += ["-E", f"root_owner={uid}:{uid}"]
    argv += [out, str(DATA_DISK_BYTES // 1024**2) + "M"]
    out.unlink(missing_ok=True)
    _proc.run(argv, timeout=900)
    return out
