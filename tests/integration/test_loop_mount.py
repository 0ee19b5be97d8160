"""``agentbox.linux.loopdev.loop_mount`` (a workspace disk's mount, no ``mount``
process) against ``mount -t ext4 -o loop,nosuid,nodev,noatime``: the same mount and the
same loop device (autoclear, read-write, no direct I/O, its backing file), gone with the
unmount; a failed mount leaves no device attached."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agentbox.linux.loopdev import loop_mount
from agentbox.linux.mounts import MS_NOATIME, MS_NODEV, MS_NOSUID

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/loop-control").exists(), reason="loop devices need root"
)

COLUMNS = "AUTOCLEAR,RO,DIO,LOG-SEC,OFFSET,SIZELIMIT,BACK-FILE"


def _mount_of(path: Path) -> tuple[list[str], str] | None:
    """(the mountinfo line less its ids, mount point and device numbers; the source)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            sep = fields.index("-")
            return [fields[3], fields[5], *fields[sep + 1 : sep + 2], *fields[sep + 3 :]], fields[
                sep + 2
            ]
    return None


def _attached(image: Path) -> str:
    return subprocess.run(
        ["losetup", "-j", image], capture_output=True, text=True, check=True
    ).stdout.strip()


def _loop(dev: str) -> str:
    return subprocess.run(
        ["losetup", "-l", "-n", "-O", COLUMNS, dev], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_loop_mount_mounts_as_mount_o_loop_does(tmp_path: Path) -> None:
    content = tmp_path / "content"
    content.mkdir()
    (content / "f").write_text("x")
    image = tmp_path / "disk.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-d", content, image, "32768k"], check=True)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    dev = loop_mount(image, ours, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
    try:
        got = _mount_of(ours)
        assert got is not None and got[1] == dev
        assert (ours / "f").read_text() == "x"
        ours_loop = _loop(dev)
    finally:
        subprocess.run(["umount", ours], check=True)
    assert _attached(image) == ""  # autoclear: gone with the unmount
    subprocess.run(
        ["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", image, theirs], check=True
    )
    try:
        want = _mount_of(theirs)
        assert want is not None
        theirs_loop = _loop(want[1])
    finally:
        subprocess.run(["umount", theirs], check=True)
    assert got[0] == want[0]
    assert ours_loop == theirs_loop
    assert "nosuid" in got[0][1] and "nodev" in got[0][1] and "noatime" in got[0][1]
    assert _attached(image) == ""


def test_a_failed_mount_leaves_no_device(tmp_path: Path) -> None:
    image = tmp_path / "not-ext4.img"
    image.write_bytes(b"\0" * (1 << 20))
    target = tmp_path / "t"
    target.mkdir()
    with pytest.raises(OSError):
        loop_mount(image, target, "ext4", MS_NOSUID | MS_NODEV)
    assert _mount_of(target) is None
    assert _attached(image) == ""
