"""The end of a workspace disk off the task's path (issue 35 §2, the end side).

Settling a disk copies it back, then takes it out of the mount tree while an fd on
its root is held (``umount2(MNT_DETACH)``): the workspace is a plain directory, its
record and image gone, the moment the settle returns; the filesystem's own end (its
sync, the loop device's release) comes with the fd's close on a thread of its own.
A settler killed between the two leaves neither a mount nor a loop device: the fd
dies with it. Real loop mounts, a real settler process killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends._wsdisk import WorkspaceDisk, settle_orphan_disks, wait_released
from agentbox.boxfile import DiskLimit
from agentbox.config import Settings
from mount_helpers import assert_no_mounts_under, loops_under, mounts_under

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace disk needs root")

MiB = 1024**2


def _orphan(settings: Settings, ws: Path, name: str) -> WorkspaceDisk:
    """A mounted disk whose owner is gone, with the agent's changes on it."""
    (ws / "keep.txt").write_text("from the repo\n")
    (ws / "gone.txt").write_text("deleted by the agent\n")
    disk = WorkspaceDisk(settings, name, ws, DiskLimit(size=64 * MiB, inodes=4096))
    disk.mount()
    (ws / "late.txt").write_text("written on the disk\n")
    (ws / "gone.txt").unlink()
    disk.hand_over(0, "")  # pid 0: an owner that is gone
    return disk


def test_a_settled_disk_leaves_a_plain_workspace_at_once_and_its_device_after(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    """When the settle returns the workspace is no mount, holds what the disk held, and
    the record and image are deleted; its loop device goes with the deferred close
    (:func:`wait_released`), leaving nothing."""
    ws = make_workspace()
    disk = _orphan(sandbox_settings, ws, "end-plain-test")
    try:
        assert settle_orphan_disks(sandbox_settings) == ["end-plain-test"]
        assert not os.path.ismount(ws)
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert (ws / "keep.txt").read_text() == "from the repo\n"
        assert not (ws / "gone.txt").exists()
        assert not disk.record.exists() and not disk.image.exists()
        assert not disk.snapshot_file.exists()
        assert wait_released(60), "a detached disk's close never ended"
        assert loops_under(sandbox_settings.data_dir) == []
        assert_no_mounts_under(sandbox_settings.data_dir)
    finally:
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)


# A settler that stops for good once its disk is detached, before the fd that holds
# the disk's filesystem is closed: the point a launcher killed after its settle is at.
DETACHED_THEN_HANG = """\
import time
from pathlib import Path
import sys
import agentbox.backends._wsdisk as w
from agentbox.config import Settings
held = []
w._close_later = held.append  # never closed: the process's death closes it
print(w.settle_orphan_disks(Settings(data_dir=Path(sys.argv[1]))), flush=True)
print(len(held), flush=True)
time.sleep(3600)
"""


def test_a_settler_killed_before_the_close_leaves_no_mount_no_device_no_image(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    """Killed while it holds the detached disk open: the workspace is already a plain
    directory with the agent's work, nothing of the disk is left on the host once its
    process is gone (the kernel closes the fd), and a later settle finds nothing to do."""
    ws = make_workspace()
    disk = _orphan(sandbox_settings, ws, "end-kill-test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", DETACHED_THEN_HANG, str(sandbox_settings.data_dir)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "['end-kill-test']\n"
        assert proc.stdout.readline() == "1\n", "the settle held no fd on the detached disk"
        # Settled, held open by the settler: no mount in the tree, the device still there.
        assert not os.path.ismount(ws)
        assert mounts_under(sandbox_settings.data_dir) == []
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert loops_under(sandbox_settings.data_dir), "the held disk's loop device is gone"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert not disk.record.exists() and not disk.image.exists()
        assert settle_orphan_disks(sandbox_settings) == []
        assert_no_mounts_under(sandbox_settings.data_dir)  # waits for the loop device to go
    finally:
        with proc:
            if proc.poll() is None:
                proc.kill()
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)


def test_release_of_an_attached_disk_detaches_it_the_same_way(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    """:meth:`WorkspaceDisk.release` (an attached sandbox's): a plain workspace with the
    disk's content at once, the image and record deleted, the device gone after."""
    ws = make_workspace()
    (ws / "keep.txt").write_text("from the repo\n")
    disk = WorkspaceDisk(
        sandbox_settings, "end-release-test", ws, DiskLimit(size=64 * MiB, inodes=4096)
    )
    disk.mount()
    try:
        (ws / "keep.txt").write_text("changed on the disk\n")
        disk.release()
        assert not os.path.ismount(ws)
        assert (ws / "keep.txt").read_text() == "changed on the disk\n"
        assert not disk.record.exists() and not disk.image.exists()
        disk.release()  # idempotent
        assert wait_released(60)
        assert_no_mounts_under(sandbox_settings.data_dir)
    finally:
        if os.path.ismount(ws):
            subprocess.run(["umount", "--lazy", str(ws)], check=False)
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)
