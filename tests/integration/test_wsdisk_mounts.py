"""The workspace disk's end without ``findmnt``, ``losetup`` or ``umount`` processes
(issue 35 §2): :func:`agentbox.backends._wsdisk._mounted_from` says what those two
commands say about the mount at a workspace, and the in-process unmounts
(:func:`agentbox.linux.mounts.umount`, the pool slot's :func:`unbind`) leave what
``umount`` leaves: the mount gone, the loop device freed; a busy one detached."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends._wsdisk import _mounted_from, _umount
from agentbox.backends.podman._pool_slots import unbind
from agentbox.linux.loopdev import loop_mount
from agentbox.linux.mounts import MS_NOATIME, MS_NODEV, MS_NOSUID, is_mount, umount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/loop-control").exists(), reason="loop devices need root"
)


def _image(tmp_path: Path, name: str) -> Path:
    image = tmp_path / name
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image, "16384k"], check=True)
    return image


def _commands_say(ws: Path, image: Path) -> bool:
    """What the code said before: findmnt's topmost source, then losetup's backing file."""
    res = subprocess.run(["findmnt", "-n", "-o", "SOURCE", "--mountpoint", ws],
                         capture_output=True, text=True)  # fmt: skip
    lines = res.stdout.split()
    src = lines[-1] if lines else ""
    if not src.startswith("/dev/loop"):
        return False
    back = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", src], capture_output=True, text=True)
    return back.stdout.strip().removesuffix(" (deleted)") == str(image)


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    ws = tmp_path / "work space"  # mountinfo escapes the space
    ws.mkdir()
    yield ws
    while is_mount(ws):
        subprocess.run(["umount", "-l", ws], check=True)


def test_mounted_from_says_what_findmnt_and_losetup_say(tmp_path: Path, ws: Path) -> None:
    image, other = _image(tmp_path, "disk.img"), _image(tmp_path, "other.img")
    for img in (image, other):  # nothing mounted: neither
        assert _mounted_from(ws, img) is _commands_say(ws, img) is False
    dev = loop_mount(image, ws, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
    assert dev.startswith("/dev/loop")
    assert _mounted_from(ws, image) is _commands_say(ws, image) is True
    assert _mounted_from(ws, other) is _commands_say(ws, other) is False
    # Another filesystem stacked on top: the topmost is not the disk.
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", ws], check=True)
    assert _mounted_from(ws, image) is _commands_say(ws, image) is False
    subprocess.run(["umount", ws], check=True)
    assert _mounted_from(ws, image) is True
    # The image deleted while mounted (losetup says "(deleted)"): still the disk.
    image.unlink()
    assert _mounted_from(ws, image) is _commands_say(ws, image) is True
    _umount(ws)
    assert not is_mount(ws)
    assert _mounted_from(ws, image) is False


def test_umount_frees_the_loop_device_and_a_busy_disk_is_detached(tmp_path: Path, ws: Path) -> None:
    image = _image(tmp_path, "disk.img")
    loop_mount(image, ws, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
    _umount(ws)
    assert not is_mount(ws)
    attached = subprocess.run(["losetup", "-j", image], capture_output=True, text=True, check=True)
    assert attached.stdout.strip() == ""  # autoclear: freed with the unmount
    # Busy (a process inside it): umount refuses, _umount detaches it lazily.
    loop_mount(image, ws, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
    holder = subprocess.Popen(["sleep", "60"], cwd=ws)
    try:
        with pytest.raises(OSError, match="busy"):
            umount(ws)
        _umount(ws)
        assert not is_mount(ws)
    finally:
        holder.kill()
        holder.wait()


def test_umount_does_not_follow_a_link(tmp_path: Path, ws: Path) -> None:
    image = _image(tmp_path, "disk.img")
    loop_mount(image, ws, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME)
    link = tmp_path / "link"
    link.symlink_to(ws)
    with pytest.raises(OSError):
        umount(link)
    assert is_mount(ws)  # the link was not followed to the mount
    umount(ws)
    assert not is_mount(ws)


def test_unbind_unmounts_a_slots_binds_busy_or_not(tmp_path: Path) -> None:
    sdir = tmp_path / "slot"
    src = tmp_path / "src"
    for d in (sdir / "ws", sdir / "gw", src):
        d.mkdir(parents=True)
    for d in (sdir / "ws", sdir / "gw"):
        subprocess.run(["mount", "--bind", src, d], check=True)
    holder = subprocess.Popen(["sleep", "60"], cwd=sdir / "gw")
    try:
        assert is_mount(sdir / "ws") and is_mount(sdir / "gw")
        unbind(sdir)
        assert not is_mount(sdir / "ws")
        assert not is_mount(sdir / "gw")  # busy: detached lazily
    finally:
        holder.kill()
        holder.wait()
        for d in (sdir / "ws", sdir / "gw"):
            while is_mount(d):
                subprocess.run(["umount", "-l", d], check=True)
