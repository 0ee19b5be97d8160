"""agentbox.safepath: nothing resolves outside the root, no link is followed.

Symlink races (a link swapped in between two calls) are out of scope here:
collection runs after the sandbox is stopped, and every open is still
RESOLVE_BENEATH/O_NOFOLLOW, so a race could only make an open fail.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentbox import safepath
from agentbox.errors import PathRefused
from agentbox.safepath import (
    RESOLVE_BENEATH,
    Kind,
    SafeWriter,
    SizeRefused,
    Tree,
    check_name,
    openat2,
)

pytestmark = pytest.mark.skipif(not safepath.supported(), reason="kernel lacks openat2")


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    out = tmp_path / "outside"
    (root / "d/e").mkdir(parents=True)
    out.mkdir()
    (out / "secret").write_text("SECRET\n")
    (root / "d/e/f.txt").write_text("inside\n")
    (root / "x.sh").write_text("#!/bin/sh\n")
    (root / "x.sh").chmod(0o4755)
    os.symlink("/etc/passwd", root / "abs-link")
    os.symlink("../../outside/secret", root / "rel-up")
    os.symlink(out, root / "dir-out")
    os.symlink("d/e/f.txt", root / "ok-link")  # pointing inside is still not followed
    os.symlink("/proc/self/root", root / "magic")
    os.mkfifo(root / "fifo")
    return root, out


def test_openat2_refuses_escapes_and_links(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(openat2(fd, "d/e/f.txt", os.O_RDONLY))
        for bad in ["../outside/secret", "/etc/passwd", "dir-out/secret", "abs-link", "rel-up",
                    "magic/etc/passwd", "d/../../outside/secret"]:  # fmt: skip
            with pytest.raises(OSError):
                os.close(openat2(fd, bad, os.O_RDONLY))
        # RESOLVE_BENEATH alone still allows a link that stays inside, but not one out.
        os.close(openat2(fd, "ok-link", os.O_RDONLY, resolve=RESOLVE_BENEATH))
        with pytest.raises(OSError):
            os.close(openat2(fd, "abs-link", os.O_RDONLY, resolve=RESOLVE_BENEATH))
    finally:
        os.close(fd)


def test_walk_reports_kinds_without_following(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    with Tree(root) as tree:
        entries = {e.path: e for e in tree.walk()}
    assert entries[b"dir-out"].kind is Kind.SYMLINK
    assert not any(p.startswith(b"dir-out/") for p in entries)
    assert entries[b"fifo"].kind is Kind.OTHER and entries[b"fifo"].other == "fifo"
    assert entries[b"d/e/f.txt"].kind is Kind.FILE and entries[b"d/e/f.txt"].size == 7
    assert entries[b"x.sh"].mode & stat.S_ISUID
    assert entries[b"d"].kind is Kind.DIR


def test_walk_prune_and_scan(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    with Tree(root) as tree:
        pruned = [e.path for e in tree.walk(prune=lambda r: r == b"d")]
        assert b"dir-out" in pruned and not any(p == b"d" or p.startswith(b"d/") for p in pruned)
        scanned = {
            prefix + name for prefix, ents in tree.scan(lambda r: r != "d/e") for name, _ in ents
        }
    assert "d/e" in scanned and "d/e/f.txt" not in scanned and "fifo" in scanned


def test_read_open_readlink(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    with Tree(root) as tree:
        assert tree.read("d/e/f.txt", limit=100) == b"inside\n"
        with pytest.raises(SizeRefused):
            tree.read("d/e/f.txt", limit=3)
        for bad in ["abs-link", "rel-up", "dir-out/secret", "ok-link", "fifo", "d", "magic"]:
            with pytest.raises(PathRefused):
                tree.read(bad, limit=100)
        assert tree.readlink("dir-out") == os.fsencode(layout[1])
        assert tree.readlink(b"rel-up") == b"../../outside/secret"
        assert tree.lstat("abs-link").kind is Kind.SYMLINK


def test_walk_skips_other_filesystems_and_depth(tmp_path: Path) -> None:
    deep = tmp_path / "r"
    p = deep
    for _ in range(5):
        p = p / "n"
    p.mkdir(parents=True)
    with Tree(deep, max_depth=2) as tree:
        list(tree.walk())
        assert tree.skipped and "deeper" in tree.skipped[0][1]
    if os.path.ismount("/proc"):
        with Tree(Path("/")) as tree:  # /proc is another filesystem below /
            list(tree.scan(lambda r: r == "proc"))
            assert any(p == b"proc" and "filesystem" in why for p, why in tree.skipped)


@pytest.mark.parametrize(
    "name",
    ["", "/abs", "a/../b", "..", "a//b", "./a", "a/.", "nul\0", "new\nline", "del\x7f",
     "x" * 256, "a/" * 2049],
)  # fmt: skip
def test_check_name_refuses(name: str) -> None:
    with pytest.raises(PathRefused):
        check_name(name)


@given(st.binary(min_size=1, max_size=64))
@settings(max_examples=200, deadline=None)
def test_check_name_never_accepts_escapes(raw: bytes) -> None:
    try:
        parts = check_name(raw)
    except PathRefused:
        return
    assert not raw.startswith(b"/")
    assert all(p not in (b"", b".", b"..") and b"\0" not in p and b"\n" not in p for p in parts)


def test_writer_writes_beneath_and_normalises_modes(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    with SafeWriter(root) as w:
        assert w.write_file("a/b/c.txt", b"hello", mode=0o4755) == 5
        w.write_file("a/b/d.txt", io.BytesIO(b"x" * 3), mode=0o2666)
        w.write_file("a/e.txt", iter([b"1", b"2"]))
        w.mkdir("m/n", mode=0o3777)
        w.symlink("a/link", "/etc/passwd")
    assert (root / "a/b/c.txt").read_bytes() == b"hello"
    assert stat.S_IMODE(os.stat(root / "a/b/c.txt").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(root / "a/b/d.txt").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(root / "m/n").st_mode) == 0o755
    assert (root / "a/e.txt").read_bytes() == b"12"
    assert os.readlink(root / "a/link") == "/etc/passwd"


def test_writer_never_writes_through_links(tmp_path: Path) -> None:
    root, out = tmp_path / "out", tmp_path / "victim"
    root.mkdir()
    out.mkdir()
    (out / "target").write_text("keep\n")
    os.symlink(out, root / "dirlink")
    os.symlink(out / "target", root / "filelink")
    with SafeWriter(root) as w:
        for rel in ["dirlink/x", "dirlink/target", "filelink", "../victim/x", "/tmp/x"]:
            with pytest.raises(PathRefused):
                w.write_file(rel, b"evil")
        with pytest.raises(PathRefused):
            w.mkdir("dirlink/sub")
        with pytest.raises(PathRefused):
            w.symlink("dirlink/l", "x")
        with pytest.raises(PathRefused):
            w.special("dev", "char device")
        w.write_file("f", b"1")
        with pytest.raises(PathRefused):
            w.write_file("f", b"2")  # never overwrites
    assert sorted(os.listdir(out)) == ["target"]
    assert (out / "target").read_text() == "keep\n"


def test_writer_caps_remove_partial_files(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    with SafeWriter(root, max_file_size=10, max_total_size=15) as w:
        with pytest.raises(SizeRefused):
            w.write_file("big", iter([b"x" * 6, b"x" * 6]))
        assert not (root / "big").exists()
        w.write_file("a", b"x" * 10)
        with pytest.raises(SizeRefused):
            w.write_file("b", b"x" * 6)
        assert not (root / "b").exists()
        assert w.written == 10


def test_root_must_not_be_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(PathRefused):
        Tree(tmp_path / "link")
    with pytest.raises(PathRefused):
        SafeWriter(tmp_path / "link")


def test_listing_is_bounded(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"f{i}").write_text("x")
    with Tree(tmp_path, max_entries=3) as tree, pytest.raises(SizeRefused):
        list(tree.walk())
    with Tree(tmp_path, max_entries=5) as tree:
        assert len(list(tree.walk())) == 5
