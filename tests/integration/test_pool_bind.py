"""A pool claim's binds (``_pool_slots.bind``, made with ``mount(2)``) against what the
``mount`` commands it replaced make: the same mount, with the same flags, in the place
it is moved to; and a refused option or a failed step leaves nothing mounted."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.podman._pool_slots import bind

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def _mount_of(path: Path) -> list[str] | None:
    """The mountinfo line of the mount at ``path`` (its options and what it mounts), less
    its ids and mount point; None if nothing is mounted there."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            sep = fields.index("-")
            return [fields[3], fields[5], *fields[6:sep], *fields[sep:]]
    return None


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Path]:
    # A private mount of its own, as the data dir's stage is (a move out of a shared
    # mount is refused).
    subprocess.run(["mount", "--bind", tmp_path, tmp_path], check=True)
    subprocess.run(["mount", "--make-private", tmp_path], check=True)
    try:
        yield tmp_path
    finally:
        for name in ("ours", "theirs", "stage-ours", "stage-theirs", "stage", "t"):
            if _mount_of(tmp_path / name) is not None:
                subprocess.run(["umount", "-l", tmp_path / name], check=True)
        subprocess.run(["umount", "-l", tmp_path], check=True)


@pytest.mark.parametrize("opts", ["nosuid,nodev", "nosuid,nodev,noexec"])
def test_bind_makes_the_mount_the_mount_commands_made(place: Path, opts: str) -> None:
    src = place / "src"
    src.mkdir()
    (src / "f").write_text("x")
    ours, theirs = place / "ours", place / "theirs"
    ours.mkdir()
    theirs.mkdir()
    bind(src, ours, opts, stage=place / "stage-ours")
    stage = place / "stage-theirs"
    stage.mkdir()
    subprocess.run(["mount", "--bind", src, stage], check=True)
    subprocess.run(["mount", "-o", f"remount,bind,{opts}", stage], check=True)
    subprocess.run(["mount", "--move", stage, theirs], check=True)
    stage.rmdir()
    got, want = _mount_of(ours), _mount_of(theirs)
    assert got is not None and want is not None
    assert got == want
    for opt in opts.split(","):
        assert opt in got[1].split(","), got
    assert (ours / "f").read_text() == "x"
    assert not (place / "stage-ours").exists()  # the stage is gone, nothing left there


def test_an_unknown_option_is_refused_before_anything_is_mounted(place: Path) -> None:
    src, target = place / "src", place / "t"
    src.mkdir()
    target.mkdir()
    with pytest.raises(ValueError, match="bind option"):
        bind(src, target, "nosuid,suid", stage=place / "stage")
    assert _mount_of(target) is None
    assert not (place / "stage").exists()


def test_a_failed_move_leaves_no_mount(place: Path) -> None:
    src = place / "src"
    src.mkdir()
    with pytest.raises(OSError):
        bind(src, place / "missing", "nosuid,nodev", stage=place / "stage")
    assert _mount_of(place / "stage") is None
    assert not (place / "stage").exists()
