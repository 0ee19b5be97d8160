"""prepare's base cache with real git: a hit gives the same workspace without git's work,
a new commit is a new entry, and nothing of the cache reaches the agent's ``.git``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_collect_support import git, make_repo, prepare_in, repo_state

from agentbox.collect import _prepare as prep
from agentbox.collect import collect, publish

FILES = {
    "README.md": "hello\n",
    "src/app.py": "def f():\n    return 1\n",
    "bin/run.sh": "#!/bin/sh\necho run\n",
    "crlf.txt": b"one\r\ntwo\r\n",
}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = make_repo(tmp_path / "user repo", FILES, mode_x=("bin/run.sh",))
    os.symlink("src/app.py", r / "app-link")
    git(r, "add", "app-link")
    git(r, "commit", "-q", "-m", "link")
    return r


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each commit prepare fetched from the user's repo (a cache miss)."""
    seen: list[str] = []
    real: Callable[..., None] = prep._fetch_base

    def counting(shadow, repo, sha, **kw):  # type: ignore[no-untyped-def]
        seen.append(sha)
        real(shadow, repo, sha, **kw)

    monkeypatch.setattr(prep, "_fetch_base", counting)
    return seen


def _tree(root: Path, *, skip_git: bool = True) -> dict[str, object]:
    """Every entry under ``root``: a link's target, a file's bytes and executable bit."""
    out: dict[str, object] = {}
    for top, dirs, files in os.walk(root):
        if skip_git and ".git" in dirs:
            dirs.remove(".git")
        for name in files:
            p = Path(top, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (p.read_bytes(), os.stat(p).st_mode & 0o111)
    return out


def _inodes(root: Path) -> set[tuple[int, int]]:
    return {
        (st.st_dev, st.st_ino)
        for top, _d, files in os.walk(root)
        for st in (os.lstat(Path(top, f)) for f in files)
    }


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for top, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            h.update(name.encode() + Path(top, name).read_bytes())
    return h.hexdigest()


def test_a_hit_gives_the_same_workspace_without_fetching(
    repo: Path, tmp_path: Path, fetches: list[str]
) -> None:
    cache = tmp_path / "cache"
    before = repo_state(repo)
    plain = prepare_in(tmp_path / "plain", repo)
    first = prepare_in(tmp_path / "t1", repo, cache=cache)
    assert len(fetches) == 2  # no cache, then a miss
    second = prepare_in(tmp_path / "t2", repo, cache=cache)
    assert len(fetches) == 2  # the hit fetched nothing
    for p in (first, second):
        assert p.base == plain.base
        assert _tree(p.ws) == _tree(plain.ws)
        assert git(p.ws, "rev-parse", "HEAD^{tree}").strip() == plain.base.tree
        assert git(p.ws, "status", "--porcelain") == ""
        git(p.ws, "fsck", "--strict", "--no-dangling")
        assert not (p.ws / ".git/objects/info/alternates").exists()
    # The shadow dir from the cache collects and publishes as a fetched one does.
    (second.ws / "src/app.py").write_text("def f():\n    return 2\n")
    got = collect(second.ws, second.shadow, second.index, second.base, task_id="t-2",
                  message="the task")  # fmt: skip
    assert got.changed
    branch = publish(second.shadow, repo, task_id="t-2", commit=got.commit)
    assert git(repo, "rev-parse", f"{branch}^").strip() == plain.base.base_commit
    assert git(repo, "show", f"{branch}:src/app.py") == "def f():\n    return 2\n"
    assert repo_state(repo) == before


def test_a_new_head_or_an_older_base_is_another_entry(
    repo: Path, tmp_path: Path, fetches: list[str]
) -> None:
    cache = tmp_path / "cache"
    old = prepare_in(tmp_path / "t1", repo, cache=cache)
    (repo / "README.md").write_text("changed\n")
    git(repo, "commit", "-q", "-am", "second")
    new = prepare_in(tmp_path / "t2", repo, cache=cache)
    assert new.base.base_commit != old.base.base_commit
    assert (new.ws / "README.md").read_text() == "changed\n"
    assert len(fetches) == 2  # the new HEAD missed
    again = prepare_in(tmp_path / "t3", repo, cache=cache)
    assert (again.ws / "README.md").read_text() == "changed\n"
    # A resumed task's base (an older commit) is its own entry, still there.
    older = prepare_in(tmp_path / "t4", repo, cache=cache, commit=old.base.base_commit)
    assert (older.ws / "README.md").read_text() == "hello\n"
    assert older.base.tree == old.base.tree
    assert len(fetches) == 2
    # Uncommitted changes: the base is ours on top of HEAD, not the cached tree.
    (repo / "README.md").write_text("dirty\n")
    dirty = prepare_in(tmp_path / "t5", repo, cache=cache, include_uncommitted=True)
    assert (dirty.ws / "README.md").read_text() == "dirty\n"
    assert git(dirty.ws, "status", "--porcelain") == ""
    assert dirty.base.tree != new.base.tree


def test_the_agent_rewriting_its_git_reaches_neither_the_cache_nor_the_users_objects(
    repo: Path, tmp_path: Path, fetches: list[str]
) -> None:
    cache = tmp_path / "cache"
    prepare_in(tmp_path / "t1", repo, cache=cache)
    p = prepare_in(tmp_path / "t2", repo, cache=cache)
    assert len(fetches) == 1
    theirs = _inodes(p.ws / ".git")
    # Not one file of the agent's .git is a link to the cache, the shadow or the repo.
    assert not theirs & (_inodes(cache) | _inodes(p.shadow) | _inodes(repo / ".git"))
    sealed, user = _digest(cache), repo_state(repo)
    # The agent owns its .git: it overwrites every object file in place, and points it
    # at the user's objects.
    for top, _d, files in os.walk(p.ws / ".git/objects"):
        for name in files:
            f = Path(top, name)
            f.chmod(0o644)
            with f.open("r+b") as fh:
                fh.write(b"\0" * max(1, f.stat().st_size))
    (p.ws / ".git/objects/info/alternates").write_text(f"{repo / '.git/objects'}\n")
    assert _digest(cache) == sealed
    assert repo_state(repo) == user
    nxt = prepare_in(tmp_path / "t3", repo, cache=cache)
    assert len(fetches) == 1
    git(nxt.ws, "fsck", "--strict", "--no-dangling")
    assert git(nxt.ws, "rev-parse", "HEAD^{tree}").strip() == nxt.base.tree


@pytest.mark.parametrize("damage", ["entry", "pack", "mode"])
def test_a_damaged_or_open_cache_is_a_miss(
    damage: str, repo: Path, tmp_path: Path, fetches: list[str]
) -> None:
    cache = tmp_path / "cache"
    plain = prepare_in(tmp_path / "t1", repo, cache=cache)
    (entry,) = [e for e in cache.iterdir() if not e.name.startswith(".")]
    if damage == "entry":
        (entry / "entry.json").write_text('{"tree": "../../x", "pack": 1}')
    elif damage == "pack":  # removed meanwhile (trimmed by another prepare)
        for f in entry.glob("pack-*"):
            f.unlink()
    else:  # a cache dir others may write is not trusted
        cache.chmod(0o770)
    p = prepare_in(tmp_path / "t2", repo, cache=cache)
    assert len(fetches) == 2
    assert _tree(p.ws) == _tree(plain.ws)
    git(p.ws, "fsck", "--strict", "--no-dangling")


def test_the_cache_keeps_the_newest_entries_within_its_bounds(
    repo: Path, tmp_path: Path, fetches: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.collect import _basecache

    monkeypatch.setattr(_basecache, "KEEP", 2)
    cache = tmp_path / "cache"
    shas = []
    for i in range(3):
        (repo / "README.md").write_text(f"v{i}\n")
        git(repo, "commit", "-q", "-am", f"v{i}")
        shas.append(prepare_in(tmp_path / f"t{i}", repo, cache=cache).base.base_commit)
        os.utime(next(e for e in cache.iterdir() if shas[-1] in e.name), (i + 1, i + 1))
    kept = sorted(e.name for e in cache.iterdir())
    assert len(kept) == 2 and not any(shas[0] in k for k in kept), kept
    monkeypatch.setattr(_basecache, "KEEP_BYTES", 1)  # only the newest, whatever its size
    (repo / "README.md").write_text("v3\n")
    git(repo, "commit", "-q", "-am", "v3")
    newest = prepare_in(tmp_path / "t3", repo, cache=cache).base.base_commit
    (only,) = cache.iterdir()
    assert newest in only.name
