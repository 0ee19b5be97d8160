"""The faster prepare, proved safe: no whole-second wait, reflinked workspaces.

* ``prepare`` no longer sleeps into the next second. git compares ctime in
  whole seconds, so a write the agent makes in the snapshot's own second (size
  and mtime kept) would pass git's stat check: collection compares the files
  saved in that second at full precision itself (the ``.racy`` sidecar). The
  test makes exactly that write and, as a positive control, shows that git alone
  (the sidecar removed) misses it.
* Where the filesystem can clone (XFS here, on a loop device made by the test),
  workspace files are reflinks of the user's work-tree files, verified as the
  base blobs; a file that is not the base blob is written as before, and a later
  edit of the user's file does not show in the workspace. On ext4 (no reflink)
  everything is written, with the same bytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_collect_support import git, make_repo, prepare_in

from agentbox.collect import collect

FILES = {"a.txt": "aaaa\n", "src/b.py": "B = 1\n", "big.bin": os.urandom(256 << 10)}


def _same_second_edit(path: Path) -> bool:
    """Rewrite ``path`` in place (same size, mtime put back); True if its ctime second held."""
    before = os.lstat(path)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(bytes([data[0] ^ 1]) + data[1:])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.lstat(path)
    assert after.st_size == before.st_size and after.st_mtime_ns == before.st_mtime_ns
    return after.st_ctime_ns // 10**9 == before.st_ctime_ns // 10**9


def test_a_write_in_the_snapshots_second_is_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    # prepare takes a fraction of a second: retry until the edit lands in the same
    # second as the saved ctime (the case git's whole-second compare cannot see).
    for attempt in range(20):
        while time.time() % 1 > 0.5:  # start early in a second
            time.sleep(0.02)
        p = prepare_in(tmp_path / f"task{attempt}", repo)
        if _same_second_edit(p.ws / "a.txt"):
            break
    else:
        pytest.skip("could not edit within the snapshot's second in 20 tries (loaded machine)")
    control = tmp_path / "control"
    shutil.copytree(p.shadow, control / "shadow.git")
    for suffix in ("", ".tree", ".stat"):
        shutil.copy2(f"{p.index}{suffix}", control / f"base.index{suffix}")

    # Collect in a later second, as a real task would: git then trusts every entry
    # whose stat matches in whole seconds (no "racily clean" re-read to save it).
    edited = os.lstat(p.ws / "a.txt").st_ctime_ns // 10**9
    while time.time() // 1 <= edited:
        time.sleep(0.05)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m")
    assert got.changed and got.diffstat.files_changed == 1, got
    with monkeypatch.context() as m:  # and with git judging the rest
        m.setattr("agentbox.collect._collect.SMALL_BASE_KEYS", -1)
        again = collect(p.ws, p.shadow, p.index, p.base, task_id="t-3", message="m")
    assert again.changed and again.diffstat.files_changed == 1, again
    assert git(p.repo, "--git-dir", str(p.shadow), "show", f"{got.commit}:a.txt").startswith("`")

    # Positive control: without the racy sidecar (git alone), the edit is missed.
    monkeypatch.setattr("agentbox.collect._collect.SMALL_BASE_KEYS", -1)  # however small
    missed = collect(p.ws, control / "shadow.git", control / "base.index", p.base,
                     task_id="t-2", message="m")  # fmt: skip
    assert not missed.changed, "the control should miss a same-second edit"


def _newest_ctime(ws: Path) -> int:
    """The newest ctime of the work tree prepare saved (not its ``.git``, written after)."""
    newest = os.lstat(ws).st_ctime_ns
    for top, dirs, files in os.walk(ws):
        if top == str(ws):
            dirs.remove(".git")
        for name in (*dirs, *files):
            newest = max(newest, os.lstat(os.path.join(top, name)).st_ctime_ns)
    return newest


def test_prepare_unsettled_leaves_the_clock_tick_to_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher calls prepare's wait (the timestamp clock past every saved ctime, so
    that an agent's write cannot keep one) just before the sandbox starts, after its own
    work: prepare_unsettled returns without it and its callable waits, for the work
    tree's newest ctime; prepare() itself still returns settled."""
    from agentbox.collect import _prepare, prepare, prepare_unsettled

    waits: list[int] = []
    real = _prepare._past

    def past(newest: int, *, fine: bool) -> None:
        waits.append(newest)
        real(newest, fine=fine)

    monkeypatch.setattr(_prepare, "_past", past)
    coarse = getattr(time, "CLOCK_REALTIME_COARSE", 5)
    repo = make_repo(tmp_path / "repo", FILES)
    (tmp_path / "u").mkdir()
    ws = tmp_path / "u" / "ws"
    base, settle = prepare_unsettled(repo, ws, tmp_path / "u" / "sh.git", tmp_path / "u" / "ix")
    assert base.base_commit and waits == [], "prepare_unsettled waited itself"
    settle()
    assert waits == [_newest_ctime(ws)]
    assert time.clock_gettime_ns(coarse) > waits[0]
    (tmp_path / "s").mkdir()
    ws = tmp_path / "s" / "ws"
    prepare(repo, ws, tmp_path / "s" / "sh.git", tmp_path / "s" / "ix")
    assert waits[1:] == [_newest_ctime(ws)], "prepare() returned unsettled"


@pytest.fixture(scope="module")
def xfs_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A small XFS (reflink on) on a loop device, mounted for this module; removed after."""
    tmp_path = tmp_path_factory.mktemp("xfs")
    if os.geteuid() != 0:
        pytest.skip("mounting a loop filesystem needs root")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs not installed (xfsprogs; scripts/setup.sh installs it)")
    image, mnt = tmp_path / "xfs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # XFS's minimum is 300 MiB
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    mnt.mkdir()
    res = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a loop XFS here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def xfs(xfs_mount: Path, tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on the module's XFS, emptied after the test."""
    d = xfs_mount / tmp_path.name
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _shared(path: Path) -> bool:
    """Does ``path`` have an extent shared with another file (FIEMAP, via filefrag)?"""
    out = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True).stdout
    return "shared" in out


def test_workspace_files_are_verified_reflinks_on_xfs(xfs: Path) -> None:
    repo = make_repo(xfs / "repo", FILES)
    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "src/b.py").write_text("B = 2\n")  # differs from the base commit: written
    git(repo, "commit", "-qam", "b2")
    p = prepare_in(xfs / "task", repo, commit=first)
    assert (p.ws / "big.bin").read_bytes() == FILES["big.bin"]
    assert (p.ws / "src/b.py").read_text() == "B = 1\n"  # the base's bytes, not the work tree's
    assert _shared(p.ws / "big.bin"), "the big file should be a reflink of the user's"
    assert not _shared(p.ws / "src/b.py")
    # Copy-on-write: the user's later edit stays out of the workspace.
    with open(repo / "big.bin", "r+b") as f:
        f.write(b"user edit")
    assert (p.ws / "big.bin").read_bytes() == FILES["big.bin"]
    # And collection works on the clone as on a written copy.
    (p.ws / "a.txt").write_text("agent\n")
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m")
    assert got.changed and got.diffstat.files_changed == 1


def test_a_hard_link_in_the_repo_is_written_not_cloned(xfs: Path) -> None:
    repo = make_repo(xfs / "repo", FILES)
    os.link(repo / "big.bin", xfs / "elsewhere")  # a second name outside the repo
    p = prepare_in(xfs / "task", repo)
    assert (p.ws / "big.bin").read_bytes() == FILES["big.bin"]
    assert not _shared(p.ws / "big.bin")


def test_without_reflink_every_file_is_written(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    p = prepare_in(tmp_path / "task", repo)
    assert {r: (p.ws / r).read_bytes() for r in FILES} == {
        r: v.encode() if isinstance(v, str) else v for r, v in FILES.items()
    }
