"""The user's repo is opened once; a link swapped in afterwards redirects nothing (issue 11, 9).

The launcher checks the repo path (inside the repos root, resolving to itself),
then :func:`agentbox.collect.prepare` used to resolve it again by name and run
every git command on that name. The repos root belongs to users: between the
check and the copy, the repo's owner can swap their repo for a symlink to a
repository they cannot read (root's), and the privileged launcher, which runs
git as the owner of whatever ``.git`` it finds, copied *that* into the
workspace they get back. Now the directory is opened once (``openat2`` beneath
the repos root, no symlink followed) and git runs in that descriptor, as the
owner of that very directory.

The swap happens in a test hook placed after the launcher's check and inside
``prepare``/``publish`` (the first step each takes), with real git, real
files, real uids.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_collect_support import all_objects, git, make_repo

from agentbox.collect import _prepare, _publish, collect, prepare, publish
from agentbox.errors import AgentboxError, PathRefused, RefusedError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: repos of two uids")

OWNER = 12345
SECRET = "TOP SECRET of root's repository"


@pytest.fixture
def top() -> Iterator[Path]:
    """A scratch dir the repo's owner can traverse (pytest's tmp_path is root-only)."""
    with tempfile.TemporaryDirectory(prefix="abx-open-once-") as d:
        Path(d).chmod(0o755)
        yield Path(d)


@pytest.fixture
def layout(top: Path) -> tuple[Path, Path, Path]:
    """(repos root, the user's repo in it, root's secret repo outside it)."""
    tmp_path = top
    root = tmp_path / "repos"
    root.mkdir()
    repo = make_repo(root / "proj", {"public.txt": "the user's own file\n"})
    subprocess.run(["chown", "-R", f"{OWNER}:{OWNER}", str(repo)], check=True)
    secret = make_repo(tmp_path / "private" / "vault", {"secret.txt": SECRET + "\n"})
    (tmp_path / "private").chmod(0o700)  # root's: the owner of proj cannot even look
    return root, repo, secret


def _swap(repo: Path, target: Path) -> None:
    """What the repo's owner does: move the checked repo away, put a link in its place."""
    repo.rename(repo.with_name(repo.name + "-moved"))
    os.symlink(target, repo)


def test_a_link_swapped_in_after_the_check_does_not_redirect_the_copy(
    layout: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap comes after every check (path, top level, HEAD, dirty state), right
    before the uncommitted changes are snapshotted with ``git add -A``."""
    _root, repo, secret = layout
    (repo / "public.txt").write_text("an uncommitted edit\n")
    real_snapshot = _prepare._snapshot_uncommitted
    swapped: list[bool] = []

    def racing_owner(*args: object, **kw: object) -> object:
        _swap(repo, secret)
        swapped.append(True)
        return real_snapshot(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_prepare, "_snapshot_uncommitted", racing_owner)
    ws, shadow, index = tmp_path / "ws", tmp_path / "shadow.git", tmp_path / "base.index"
    with contextlib.suppress(AgentboxError):  # failing is not the bug; copying the secret is
        prepare(repo, ws, shadow, index, include_uncommitted=True)
    assert swapped
    copied = {p.name for p in ws.rglob("*")} if ws.exists() else set()
    assert "secret.txt" not in copied
    assert not shadow.exists() or SECRET.encode() not in all_objects(shadow)
    # The copy is of the directory that was checked, uncommitted edit included.
    assert (ws / "public.txt").read_text() == "an uncommitted edit\n"


def test_a_link_in_place_when_opened_is_refused(
    layout: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root, repo, secret = layout
    _swap(repo, secret)
    ws = tmp_path / "ws"
    with pytest.raises(PathRefused, match="link"):
        prepare(repo, ws, tmp_path / "s.git", tmp_path / "i", root=root)
    assert not ws.exists() and not (tmp_path / "s.git").exists()
    # A link higher up, inside the root, is refused the same way.
    (root / "team").symlink_to(repo.with_name("proj-moved").parent)
    with pytest.raises(PathRefused):
        prepare(root / "team" / "proj-moved", ws, tmp_path / "s.git", tmp_path / "i", root=root)


def test_git_runs_as_the_owner_of_the_opened_directory(
    layout: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A ``.git`` that is a link to root's repository: git runs as the directory's owner
    (who cannot read root's), so nothing of root's is copied."""
    _root, repo, secret = layout
    subprocess.run(["rm", "-rf", str(repo / ".git")], check=True)
    os.symlink(secret / ".git", repo / ".git")
    ws = tmp_path / "ws"
    shadow = tmp_path / "s.git"
    with pytest.raises(RefusedError):  # git, run as 12345, cannot read root's repository
        prepare(repo, ws, shadow, tmp_path / "i", include_uncommitted=True)
    assert not ws.exists() or not (ws / "secret.txt").exists()
    assert not shadow.exists() or SECRET.encode() not in all_objects(shadow)


def test_a_link_swapped_in_before_publishing_does_not_redirect_the_branch(
    layout: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, repo, secret = layout
    ws, shadow, index = tmp_path / "ws", tmp_path / "shadow.git", tmp_path / "base.index"
    base = prepare(repo, ws, shadow, index, root=root)
    (ws / "public.txt").write_text("agent\n")
    got = collect(ws, shadow, index, base, task_id="t-1", message="m")
    real_tempdir = _publish.owner_tempdir

    def racing_owner(*args: object, **kw: object) -> Path:
        _swap(repo, secret)
        return real_tempdir(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_publish, "owner_tempdir", racing_owner)
    with contextlib.suppress(PathRefused):
        publish(shadow, repo, task_id="t-1", commit=got.commit)
    assert "agentbox/t-1" not in git(secret, "for-each-ref")
    moved = repo.with_name("proj-moved")
    assert git(moved, "rev-parse", "refs/heads/agentbox/t-1").strip() == got.commit
    owners = {os.lstat(Path(d, n)).st_uid for d, ds, fs in os.walk(moved / ".git")
              for n in ds + fs}  # fmt: skip
    assert owners == {OWNER}
