"""Bad input is refused before anything is created, and the user's repo is untouched.

Real git, a real SQLite store, the real launcher; no sandbox is ever reached
because every request here is refused during validation.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentbox.config import Settings
from agentbox.errors import PathRefused, PolicyRefused, RefusedError, TaskIdRefused
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._agent import AGENT_FLAGS, agent_argv, agent_env, check_agent_argv, check_env
from agentbox.launcher.api import MAX_BUDGET, MAX_DEADLINE, MIN_DEADLINE

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@localhost",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "a.py").write_text("x = 1\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def tree_hash(root: Path) -> str:
    """Every path, mode, link target and file content under ``root`` (.git included)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def repo(settings: Settings) -> Path:
    return make_repo(settings.repos_root / "proj")


@pytest.fixture
def launcher(settings: Settings) -> Launcher:
    lau = Launcher(settings, max_tasks=1)
    yield lau
    lau.close()


def assert_nothing_created(settings: Settings, launcher: Launcher) -> None:
    assert not (settings.data_dir / "tasks").exists()
    assert launcher.list() == []


@pytest.mark.parametrize("bad", ["..", "a/b", "../etc", "Upper", "a" * 65, "", "a b", "a_b"])
def test_bad_task_ids_refused_by_the_schema(bad: str, repo: Path) -> None:
    with pytest.raises(ValidationError):
        TaskRequest(repo=str(repo), task="x", task_id=bad)


@pytest.mark.parametrize("bad", ["..", "a/b", "Upper", "a" * 65])
def test_bad_task_ids_refused_by_the_launcher(
    bad: str, repo: Path, settings: Settings, launcher: Launcher
) -> None:
    # model_construct skips the schema: the launcher must refuse on its own.
    req = TaskRequest.model_construct(
        repo=str(repo), task="x", task_id=bad, model=None, budget=None, deadline=None,
        include_uncommitted=False, publish=True,
    )  # fmt: skip
    before = tree_hash(repo)
    with pytest.raises(TaskIdRefused):
        launcher.submit(req)
    assert_nothing_created(settings, launcher)
    assert tree_hash(repo) == before


def _refused(launcher: Launcher, settings: Settings, repo: Path, **kw: object) -> RefusedError:
    before = tree_hash(repo) if repo.exists() else ""
    fields: dict[str, object] = {"repo": str(repo), "task": "do it", **kw}
    req = TaskRequest.model_construct(
        **{"model": None, "budget": None, "deadline": None, "task_id": None,
           "include_uncommitted": False, "publish": True, **fields}
    )  # fmt: skip
    with pytest.raises(RefusedError) as info:
        launcher.submit(req)
    assert_nothing_created(settings, launcher)
    if before:
        assert tree_hash(repo) == before
    return info.value


def test_repo_outside_the_repos_root(
    tmp_path: Path, settings: Settings, launcher: Launcher
) -> None:
    outside = make_repo(tmp_path / "elsewhere")
    err = _refused(launcher, settings, outside)
    assert isinstance(err, PathRefused)


def test_symlink_to_a_repo_outside(tmp_path: Path, settings: Settings, launcher: Launcher) -> None:
    outside = make_repo(tmp_path / "elsewhere")
    link = settings.repos_root / "link"
    link.symlink_to(outside)
    before = tree_hash(outside)
    err = _refused(launcher, settings, link)
    assert isinstance(err, PathRefused)
    assert tree_hash(outside) == before


def test_relative_repo_and_not_a_repo(settings: Settings, launcher: Launcher) -> None:
    plain = settings.repos_root / "plain"
    plain.mkdir()
    assert isinstance(_refused(launcher, settings, plain), PathRefused)
    req = TaskRequest(repo="proj", task="x")
    with pytest.raises(PathRefused):
        launcher.submit(req)


def test_the_repos_root_itself_is_refused(settings: Settings, launcher: Launcher) -> None:
    make_repo(settings.repos_root / "x")
    with pytest.raises(PathRefused):
        launcher.submit(TaskRequest(repo=str(settings.repos_root), task="x"))


def test_uncommitted_changes_need_the_flag(
    repo: Path, settings: Settings, launcher: Launcher
) -> None:
    (repo / "a.py").write_text("x = 2\n")
    err = _refused(launcher, settings, repo)
    assert isinstance(err, PolicyRefused)
    assert "uncommitted" in str(err)


@pytest.mark.parametrize(
    "field,value",
    [
        ("deadline", MIN_DEADLINE - 1),
        ("deadline", MAX_DEADLINE + 1),
        ("budget", 0),
        ("budget", MAX_BUDGET + 1),
    ],
)
def test_ranges(
    field: str, value: float, repo: Path, settings: Settings, launcher: Launcher
) -> None:
    with pytest.raises(ValidationError):
        TaskRequest(repo=str(repo), task="x", **{field: value})
    _refused(launcher, settings, repo, **{field: value})


def test_unknown_model(repo: Path, settings: Settings, launcher: Launcher) -> None:
    err = _refused(launcher, settings, repo, model="gpt-nonexistent")
    assert "unknown model" in str(err)


def test_task_text_limits(repo: Path, settings: Settings, launcher: Launcher) -> None:
    with pytest.raises(ValidationError):
        TaskRequest(repo=str(repo), task="")
    with pytest.raises(ValidationError):
        TaskRequest(repo=str(repo), task="x" * 32769)
    _refused(launcher, settings, repo, task="a\0b")


def test_schema_is_strict_and_closed(repo: Path) -> None:
    with pytest.raises(ValidationError):
        TaskRequest.model_validate_json(f'{{"repo": "{repo}", "task": "x", "budget": "5"}}')
    with pytest.raises(ValidationError):
        TaskRequest.model_validate_json(f'{{"repo": "{repo}", "task": "x", "image": "evil"}}')


def test_duplicate_id_refused(repo: Path, settings: Settings, launcher: Launcher) -> None:
    launcher.store.insert(
        id="dup", status="done", repo=str(repo), task="x", model="replay-demo", budget=1,
        deadline=10.0, created_at=0.0,
    )  # fmt: skip
    with pytest.raises(RefusedError):
        launcher.submit(TaskRequest(repo=str(repo), task="x", task_id="dup"))


def test_agent_argv_is_claude_with_our_flags_only() -> None:
    argv = agent_argv("--evil-flag do things")
    assert argv[0] == "claude" and tuple(argv[1 : len(AGENT_FLAGS) + 1]) == AGENT_FLAGS
    assert argv[len(AGENT_FLAGS) + 1] == "--settings"
    assert argv[-2:] == ["--", "--evil-flag do things"]
    check_agent_argv(argv)
    for bad in (
        ["bash", *argv[1:]],
        [*argv[:-2], "--mcp-config", "x", "--", "t"],
        ["claude", "-p", "t"],
        [*argv[:-1], ""],
    ):
        with pytest.raises(PolicyRefused):
            check_agent_argv(bad)
    with pytest.raises(PolicyRefused):
        agent_argv("a\0b")


def test_env_allow_list() -> None:
    env = agent_env("tok" * 8)
    assert env["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    check_env({**env, "LANG": "C"}, {"LANG"})
    with pytest.raises(PolicyRefused):
        check_env({**env, "AWS_SECRET_ACCESS_KEY": "x"}, {"LANG"})
