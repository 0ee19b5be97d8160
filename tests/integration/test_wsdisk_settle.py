"""Settling a workspace disk survives its settler being killed (issue 19 item 1).

A launcher killed while it settles an orphan workspace disk (copy back, unmount)
used to leave a ``disks/.settle-*`` bind mount of the root filesystem behind, one
per kill, which nothing removed: the chaos test's data dir was deleted with them
mounted. The settle reaches the directory under the disk through a detached mount
(``open_tree``) that dies with its process, and one settler at a time works on a
data dir's disks. Real loop mounts, a real settler process killed with SIGKILL in
the middle of its copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends._wsdisk import WorkspaceDisk, settle_orphan_disks
from agentbox.boxfile import DiskLimit
from agentbox.config import Settings
from mount_helpers import assert_no_mounts_under, mounts_under

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace disk needs root")

MiB = 1024**2

# A settler that stops for good once its copy back is done, before it unmounts
# anything: the point at which a launcher killed mid-settle left its bind mount.
SETTLER = """\
import sys, time
from pathlib import Path
import agentbox.backends._wsdisk as w
from agentbox.config import Settings
real = w.copy_back
def copy_then_hang(*a, **k):
    real(*a, **k)
    print("copied", flush=True)
    time.sleep(3600)
w.copy_back = copy_then_hang
if sys.argv[2] == "bind":
    w._SYS_OPEN_TREE = 99999  # no such syscall: ENOSYS, as on Linux before 5.2
w.settle_orphan_disks(Settings(data_dir=Path(sys.argv[1])))
"""


def _orphan(settings: Settings, ws: Path, name: str) -> WorkspaceDisk:
    """A mounted disk whose owner is gone (a sandbox whose conmon died unrecorded)."""
    (ws / "keep.txt").write_text("from the repo\n")
    disk = WorkspaceDisk(settings, name, ws, DiskLimit(size=64 * MiB, inodes=4096))
    disk.mount()
    (ws / "late.txt").write_text("written on the disk\n")
    disk.hand_over(0, "")  # pid 0: an owner that is gone
    return disk


@pytest.mark.parametrize("way", ["open_tree", "bind"])
def test_a_settler_killed_mid_copy_leaves_no_mount_and_the_next_one_finishes(
    sandbox_settings: Settings, make_workspace: Callable[[], Path], way: str
) -> None:
    """Killed after its copy, before it unmounts: no mount of the settler's remains
    (``bind``: the fallback where ``open_tree`` is missing, a bind mount detached at
    once); the disk is still an orphan and the next settle finishes it."""
    ws = make_workspace()
    disk = _orphan(sandbox_settings, ws, "settle-kill-test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SETTLER, str(sandbox_settings.data_dir), way],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "copied\n", "the settler never got to its copy"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # The disk itself is still mounted (an orphan still): nothing else may be.
        left = [m for m in mounts_under(sandbox_settings.data_dir) if f" on {ws} " not in m]
        assert left == [], f"a killed settler left mounts: {left}"
        assert json.loads(disk.record.read_text())["pid"] == 0
        # The next settler finishes the job.
        assert settle_orphan_disks(sandbox_settings) == ["settle-kill-test"]
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert (ws / "keep.txt").read_text() == "from the repo\n"
        assert not disk.record.exists() and not disk.image.exists()
        assert_no_mounts_under(sandbox_settings.data_dir)
    finally:
        with proc:  # reaps it and closes its pipe
            if proc.poll() is None:
                proc.kill()
        for m in reversed(mounts_under(sandbox_settings.data_dir)):
            subprocess.run(["umount", "--lazy", m.split(" on ")[1].split(" (root")[0]], check=False)
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)


# A settler that pauses after its copy until told to go on, then prints what it settled.
PAUSED = """\
import json, sys
from pathlib import Path
import agentbox.backends._wsdisk as w
from agentbox.config import Settings
real = w.copy_back
def copy_then_wait(*a, **k):
    real(*a, **k)
    print("copied", flush=True)
    sys.stdin.readline()
w.copy_back = copy_then_wait
print(json.dumps(w.settle_orphan_disks(Settings(data_dir=Path(sys.argv[1])))), flush=True)
"""


def _blocked_or_done(thread: threading.Thread) -> bool:
    if not thread.is_alive():
        return True
    wchan = Path(f"/proc/self/task/{thread.native_id}/wchan")
    with contextlib.suppress(OSError):
        return "lock" in wchan.read_text()  # waiting on the settle lock (flock)
    return False


def test_two_settlers_at_once_settle_a_disk_once_without_error(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    """A follower and an adopter (or a start-up sweep) reach the same orphan disk at
    once: one copies back and unmounts, the other finds it settled; neither fails
    (two at once used to race: the second's unmount found nothing mounted and logged
    'could not settle an orphan workspace disk')."""
    ws = make_workspace()
    disk = _orphan(sandbox_settings, ws, "settle-race-test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED, str(sandbox_settings.data_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    got: list[list[str]] = []
    other = threading.Thread(target=lambda: got.append(settle_orphan_disks(sandbox_settings)))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "copied\n", "the settler never got to its copy"
        other.start()
        end = time.monotonic() + 60
        while not _blocked_or_done(other):
            assert time.monotonic() < end, "the second settler neither waited nor finished"
            time.sleep(0.05)
        out, err = proc.communicate("go\n", timeout=120)
        other.join(120)
        first = json.loads(out.strip().splitlines()[-1])
        assert sorted(first + got[0]) == ["settle-race-test"], (first, got)
        assert "could not settle" not in err, err
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert not disk.record.exists() and not disk.image.exists()
        assert_no_mounts_under(sandbox_settings.data_dir)
    finally:
        with proc:  # reaps it and closes its pipes
            if proc.poll() is None:
                proc.kill()
        if other.is_alive():
            other.join(120)
        for m in reversed(mounts_under(sandbox_settings.data_dir)):
            subprocess.run(["umount", "--lazy", m.split(" on ")[1].split(" (root")[0]], check=False)
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)
