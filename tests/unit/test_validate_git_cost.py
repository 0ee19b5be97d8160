"""Validating a request runs as few git processes in the user's repo as it can
(issue 15 item 2): one ``rev-parse`` for the top level and HEAD's commit, then one
``status`` unless uncommitted changes were asked for. The refusals are unchanged."""

from __future__ import annotations

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
    real = _proc.run

    def run(argv: Any, **kw: Any) -> _proc.Result:
        args = tuple(str(a) for a in argv)
        if args[0] == "git":
            runs.append(args[args.index("-C") + 2 :])
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
    assert [g[0] for g in gits] == ["rev-parse", "status"]
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
