"""A small base is judged without git: every entry's lstat against the saved keys.

Below :data:`~agentbox.collect._collect.SMALL_BASE_KEYS` collection runs no ``git
diff-files``: it lstats every entry of the workspace itself and compares type, mode,
size, mtime, ctime and inode at full precision with the keys saved before the agent
ran. What the agent can forge (mtime, size, content) does not hide a change: ctime and
inode it cannot set. Each change below is made in the snapshot's own second too (where
git's whole-second compare needs the racy sidecar), and is found by both judges.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_collect_support import git, make_repo, prepare_in

import agentbox.collect._collect as collect_mod
from agentbox.collect import collect

FILES = {"a.txt": "aaaa\n", "src/b.py": "B = 1\n", "src/c.py": "C = 1\n", "d.txt": "dddd\n"}


@pytest.fixture(params=["own lstat", "git diff-files"])
def judge(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "git diff-files":
        monkeypatch.setattr(collect_mod, "SMALL_BASE_KEYS", -1)
    return str(request.param)


def _keep_times(path: Path, change: object) -> None:
    """Run ``change`` and put ``path``'s mtime (and atime) back: what an agent can forge."""
    before = os.lstat(path)
    change()  # type: ignore[operator]
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns), follow_symlinks=False)


def test_every_forgeable_change_is_collected(tmp_path: Path, judge: str) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    (repo / "link").symlink_to("a.txt")
    git(repo, "add", "link")
    git(repo, "commit", "-q", "-m", "link")
    p = prepare_in(tmp_path / "task", repo)
    ws = p.ws
    # A same-size rewrite with the mtime put back.
    a = ws / "a.txt"
    _keep_times(a, lambda: a.write_text("AAAA\n"))
    # A chmod (+x) with the mtime put back.
    b = ws / "src/b.py"
    _keep_times(b, lambda: b.chmod(0o755))
    # A symlink swapped for one of the same length to another target.
    link = ws / "link"

    def swap() -> None:
        link.unlink()
        link.symlink_to("d.txt")

    _keep_times(link, swap)
    # A new untracked file.
    (ws / "src/new.py").write_text("NEW = 1\n")
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-small", message="m")
    assert got.changed, got
    show = lambda rev: git(p.repo, "--git-dir", str(p.shadow), *rev)  # noqa: E731
    assert show(["show", f"{got.commit}:a.txt"]) == "AAAA\n"
    assert show(["show", f"{got.commit}:src/new.py"]) == "NEW = 1\n"
    assert show(["show", f"{got.commit}:link"]) == "d.txt"
    tree = show(["ls-tree", "-r", got.commit])
    assert "100755 blob" in next(line for line in tree.splitlines() if line.endswith("src/b.py"))
    assert got.diffstat.files_changed == 4, (judge, got.diffstat)


def test_an_unchanged_workspace_starts_no_git_and_makes_no_branch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    p = prepare_in(tmp_path / "task", repo)
    ran: list[tuple[str, ...]] = []
    real = collect_mod.ShadowGit.run_bytes

    def spy(self: object, *args: str, **kw: object) -> object:
        ran.append(args)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(collect_mod.ShadowGit, "run_bytes", spy)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-same", message="m")
    assert not got.changed and got.branch == "" and got.diff == ""
    assert not [a for a in ran if "diff-files" in a], ran


def _loose(shadow: Path) -> set[str]:
    objects = shadow / "objects"
    return {f"{d.name}{f.name}" for d in objects.iterdir() if len(d.name) == 2 for f in d.iterdir()}


@pytest.mark.skipif(os.geteuid() != 0, reason="re-owning the workspace's files needs root")
def test_files_whose_stat_alone_changed_are_no_change(
    tmp_path: Path, judge: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file re-owned after the base was saved (what a pool claim does to hand the
    workspace to its sandbox's uid: each ctime moves) and one rewritten with its own
    bytes: each is read, found to be the base's blob, and left out (no blob stored, no
    base tree fetched); a real edit among them is still the change."""
    repo = make_repo(tmp_path / "repo", FILES)
    p = prepare_in(tmp_path / "task", repo)
    for path in [p.ws / name for name in FILES]:
        os.chown(path, 12345, 12345)
    (p.ws / "d.txt").write_text("dddd\n")  # the same bytes again
    before = _loose(p.shadow)
    fetched: list[list[bytes]] = []
    real = collect_mod.prefetch

    def spy(shadow: object, tree: str, paths: list[bytes], *a: object) -> object:
        fetched.append(list(paths))
        return real(shadow, tree, paths, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(collect_mod, "prefetch", spy)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-owner", message="m")
    assert not got.changed, got
    assert got.files_read == len(FILES)  # each was read: its stat said it may have changed
    assert _loose(p.shadow) == before
    # No base tree fetched above them (git's oracle fetches above what it names, meanwhile).
    assert fetched[-1] == [], fetched
    if judge == "own lstat":
        assert all(paths == [] for paths in fetched), fetched
    (p.ws / "src/c.py").write_text("C = 2\n")
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-owner", message="m")
    assert got.changed and got.diffstat.files_changed == 1, got
    assert git(p.repo, "--git-dir", str(p.shadow), "show", f"{got.commit}:src/c.py") == "C = 2\n"
