"""Copying a workspace disk back (``backends/_wsdisk_copy.py``) on plain directories.

An entry the mount-time snapshot says is untouched (same inode and ctime on the
disk) is kept as it is under the mount, without a stat of it, only when the
directory under the mount holds the same kind of entry by that name (its listing's
type); anything else is copied as the disk holds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentbox.backends._wsdisk_copy import copy_back


def _key(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_ino, st.st_ctime_ns


def _copy(disk: Path, under: Path, snap: dict[str, tuple[int, int]]) -> None:
    fd = os.open(under, os.O_RDONLY | os.O_DIRECTORY)
    try:
        copy_back(disk, fd, snap)
    finally:
        os.close(fd)


def test_untouched_entries_are_kept_and_the_rest_copied(tmp_path: Path) -> None:
    disk, under = tmp_path / "disk", tmp_path / "under"
    (disk / "sub").mkdir(parents=True)
    (under / "sub").mkdir(parents=True)
    (disk / "kept.txt").write_text("on the disk\n")
    (under / "kept.txt").write_text("under the mount\n")  # what the disk was made from
    (disk / "sub" / "kept.txt").write_text("on the disk\n")
    (under / "sub" / "kept.txt").write_text("under the mount\n")
    (disk / "changed.txt").write_text("the agent's\n")
    (under / "changed.txt").write_text("the base's\n")
    (disk / "new.txt").write_text("new\n")
    (under / "gone.txt").write_text("deleted by the agent\n")
    (disk / "link").symlink_to("kept.txt")
    (under / "link").symlink_to("elsewhere")
    snap = {
        "kept.txt": _key(disk / "kept.txt"),
        "sub/kept.txt": _key(disk / "sub/kept.txt"),
        "changed.txt": (1, 1),  # its inode or ctime changed since the mount
        "link": (2, 2),
    }
    _copy(disk, under, snap)
    assert (under / "kept.txt").read_text() == "under the mount\n"
    assert (under / "sub" / "kept.txt").read_text() == "under the mount\n"
    assert (under / "changed.txt").read_text() == "the agent's\n"
    assert (under / "new.txt").read_text() == "new\n"
    assert not (under / "gone.txt").exists()
    assert os.readlink(under / "link") == "kept.txt"


def test_an_untouched_entry_of_another_kind_under_the_mount_is_replaced(tmp_path: Path) -> None:
    """The snapshot matches, but under the mount the name is a link, a directory or a
    file where the disk has another kind: the disk's entry is copied, not kept."""
    disk, under = tmp_path / "disk", tmp_path / "under"
    disk.mkdir()
    under.mkdir()
    (disk / "was-link").write_text("a file on the disk\n")
    (under / "target").write_text("must not be written through\n")
    (under / "was-link").symlink_to("target")
    (disk / "was-dir").write_text("a file on the disk\n")
    (under / "was-dir").mkdir()
    (under / "was-dir" / "inner").write_text("x\n")
    (disk / "was-file").symlink_to("nowhere")
    (under / "was-file").write_text("a file under\n")
    (disk / "target").write_text("must not be written through\n")
    snap = {name: _key(disk / name) for name in ("was-link", "was-dir", "was-file", "target")}
    _copy(disk, under, snap)
    assert not (under / "was-link").is_symlink()
    assert (under / "was-link").read_text() == "a file on the disk\n"
    assert (under / "target").read_text() == "must not be written through\n"
    assert (under / "was-dir").is_file()
    assert (under / "was-dir").read_text() == "a file on the disk\n"
    assert os.readlink(under / "was-file") == "nowhere"
