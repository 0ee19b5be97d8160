"""The host-side copy behind a microVM's declared mount: what it carries, and what it refuses.

``make_mount_disk`` copies the declared source into a staging dir before
``mkfs.ext4 -d``; these tests run that copy (``_copy_tree``) on real trees,
including the hostile shapes a source can take.
"""

from __future__ import annotations

import inspect
import os
import socket
import stat
import sys
import threading
from pathlib import Path

import pytest

from agentbox.backends.microvm._disks import _copy_tree
from agentbox.errors import SandboxError

UID = 64000


def test_carries_dirs_files_and_links_owned_by_the_sandbox_without_special_bits(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_text("data")
    suid = src / "tool"
    suid.write_text("#!/bin/sh\n")
    suid.chmod(0o4755)
    (src / "link").symlink_to("/etc/shadow")  # kept as a link, never followed
    os.mkfifo(src / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(src / "sock"))
    os.utime(src / "a", ns=(1_000_000_000, 2_000_000_000))
    dst.mkdir()
    count = _copy_tree(src, dst, UID)
    assert count == 5  # a, a/b, a/b/f, tool, link
    assert sorted(p.name for p in dst.iterdir()) == ["a", "link", "tool"]
    assert (dst / "a" / "b" / "f").read_text() == "data"
    assert os.readlink(dst / "link") == "/etc/shadow"
    assert stat.S_IMODE((dst / "tool").stat().st_mode) == 0o755
    for p in (dst / "a", dst / "a" / "b", dst / "a" / "b" / "f", dst / "tool", dst / "link"):
        assert p.lstat().st_uid == UID
    assert (dst / "a").stat().st_mtime_ns == 2_000_000_000, "dir times set after its entries"


def test_depth_is_not_bounded_by_the_recursion_limit(tmp_path: Path) -> None:
    # A tree deeper than the recursion limit allows, under a lowered limit, so the
    # tree stays shallow enough for everything else (pytest's clean-up recurses).
    depth = 300
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 120)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    deep = str(src)
    for _ in range(depth):
        deep += "/d"
        os.mkdir(deep)
    Path(deep, "leaf").write_text("x")
    try:
        count = _copy_tree(src, dst, UID)
    finally:
        sys.setrecursionlimit(old_limit)
    assert count == depth + 1
    assert Path(str(dst) + "/d" * depth + "/leaf").read_text() == "x"


def test_a_source_that_is_a_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "dst").mkdir()
    with pytest.raises(SandboxError, match="cannot read declared mount source"):
        _copy_tree(tmp_path / "alias", tmp_path / "dst", UID)


def test_a_file_swapped_for_a_fifo_cannot_hang_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Race the scan: the file is a FIFO by the time it is opened."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "f").write_text("x")
    real_stat = os.stat

    def swap_after_stat(path: object, *a: object, **kw: object) -> os.stat_result:
        st = real_stat(path, *a, **kw)  # type: ignore[arg-type]
        if path == "f" and stat.S_ISREG(st.st_mode):
            os.unlink(src / "f")
            os.mkfifo(src / "f")
        return st

    result: list[object] = []

    def run() -> None:
        try:
            result.append(_copy_tree(src, dst, UID))
        except SandboxError as exc:
            result.append(exc)

    monkeypatch.setattr(os, "stat", swap_after_stat)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    monkeypatch.undo()
    assert not t.is_alive(), "the copy hung opening a FIFO"
    assert isinstance(result[0], SandboxError) and "no longer a regular file" in str(result[0])
