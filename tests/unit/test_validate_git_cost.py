"""Validating a request runs as few git processes in the user's repo as it can
(issue 15 item 2): one ``rev-parse`` for the top level and HEAD's commit, then one
``status`` unless uncommitted changes were asked for, beside it; a submit asks for the
repo's committed Boxfile beside them, and validates again with it without asking the
repo again; git is exec'd by its path, found once. The refusals are unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import PathRefused
from agentbox.gateway.registry import load_registry
from agentbox.launcher import _validate
from agentbox.launcher.api import TaskRequest
from git_helpers import git


def _repo(path: Path, *, commit: bool = True) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    if commit:
        (path / "a.txt").write_text("a\n")
        git(path, "add", "-A")
        git(path, "-c", "maintenance.auto=false", "commit", "-q", "-m", "init")
    return path


@pytest.fixture
def gits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every git command the validation runs (each run for real)."""
    runs: list[tuple[str, ...]] = []
    execs: list[str] = []
    real = _proc.run

    def run(argv: Any, **kw: Any) -> _proc.Result:
        args = tuple(str(a) for a in argv)
        if Path(args[0]).name == "git":
            runs.append(args[args.index("-C") + 2 :])
            execs.append(args[0])
        return real(argv, **kw)

    monkeypatch.setattr(_proc, "run", run)
    return runs


def _validate_repo(settings: Settings, repo: Path, **kw: Any) -> _validate.Validated:
    req = TaskRequest(repo=str(repo), task="do it", **kw)
    return _validate.validate(req, settings, load_registry(settings))


def test_a_clean_repo_costs_one_rev_parse_and_one_status(
    settings: Settings, gits: list[tuple[str, ...]]
) -> None:
    repo = _repo(settings.repos_root / "proj")
    assert _validate_repo(settings, repo).repo == repo
    assert sorted(g[0] for g in gits) == ["rev-parse", "status"]
    gits.clear()
    _validate_repo(settings, repo, include_uncommitted=True)
    assert [g[0] for g in gits] == ["rev-parse"]


def test_the_refusals_are_those_of_before(settings: Settings) -> None:
    empty = _repo(settings.repos_root / "empty", commit=False)
    with pytest.raises(PathRefused, match="not a git repository with a commit"):
        _validate_repo(settings, empty)
    repo = _repo(settings.repos_root / "proj")
    (repo / "sub").mkdir()
    (repo / "sub" / ".git").mkdir()  # looks like a repo, but its top level is above
    with pytest.raises(PathRefused, match="top level is"):
        _validate_repo(settings, repo / "sub")


def test_git_is_execd_by_its_path(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not "git" along PATH on every exec (each directory before git's tried in turn)."""
    argv0: list[str] = []
    real = _proc.run

    def run(argv: Any, **kw: Any) -> _proc.Result:
        argv0.append(str(argv[0]))
        return real(argv, **kw)

    monkeypatch.setattr(_proc, "run", run)
    repo = _repo(settings.repos_root / "proj")
    _validate_repo(settings, repo)
    assert argv0 and all(Path(a).is_absolute() and Path(a).name == "git" for a in argv0)
    assert argv0[0] == shutil.which("git")


class _Recorded(Exception):
    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row


def test_a_submit_with_a_committed_boxfile_asks_the_repo_once(
    settings: Settings, gits: list[tuple[str, ...]]
) -> None:
    from agentbox.launcher import Launcher

    repo = _repo(settings.repos_root / "proj")
    (repo / ".agentbox").mkdir()
    (repo / ".agentbox" / "Boxfile.toml").write_text("deadline = 321\n")
    git(repo, "add", "-A")
    git(repo, "-c", "maintenance.auto=false", "commit", "-q", "-m", "box")
    launcher = Launcher(settings, max_tasks=1)
    launcher.draining = True  # nothing is run; validate only up to the record
    try:
        gits.clear()
        with pytest.raises(Exception, match="draining"):
            launcher.submit(TaskRequest(repo=str(repo), task="do it"))
        assert gits == []  # refused before anything
        launcher.draining = False

        def insert(**row: Any) -> None:
            raise _Recorded(row)

        launcher.store.insert = insert  # type: ignore[method-assign]
        with pytest.raises(_Recorded) as recorded:
            launcher.submit(TaskRequest(repo=str(repo), task="do it"))
    finally:
        launcher.close(wait=False)
    assert recorded.value.row["deadline"] == 321  # the committed Boxfile's
    asked = sorted(g[0] for g in gits)
    assert asked.count("rev-parse") == 1 and asked.count("status") == 1, asked
    assert "ls-tree" in asked
