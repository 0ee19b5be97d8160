"""Publishing never overwrites a ref agentbox did not write (issue 11, item 8), with real git.

Publishing used to force-fetch ``+refs/heads/agentbox/<id>`` into the user's
repo: a commit of the user's own on that branch was silently replaced, and a
checked-out ``agentbox/<id>`` failed the task with its result unpublishable.
Now the branch is created compare-and-swap (absent, or at a commit agentbox
wrote there, as recorded), anything else is refused with the reason, the
result is kept, and ``agentbox publish ID [--branch NAME]`` publishes it later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_collect_support import Prepared, git, make_repo, prepare_in, repo_state

from agentbox.collect import _publish as pub
from agentbox.collect import collect, publish
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import PublishRefused, RefusedError, TaskError
from agentbox.launcher import Launcher

FILES = {"README.md": "hello\n", "src/app.py": "x = 1\n"}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "user repo", FILES)


def _result(p: Prepared, text: str = "changed\n", task_id: str = "t-1") -> str:
    (p.ws / "src/app.py").write_text(text)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id=task_id, message="the task")
    assert got.changed
    return got.commit


def _users_own_commit(repo: Path, branch: str, *, checkout: bool = False) -> str:
    """The user makes ``branch`` with a commit of their own on it."""
    if checkout:
        git(repo, "checkout", "-q", "-b", branch)
    else:
        git(repo, "branch", branch)
        git(repo, "checkout", "-q", branch)
    (repo / "mine.txt").write_text("my own work\n")
    git(repo, "add", "mine.txt")
    git(repo, "commit", "-q", "-m", "my own work")
    sha = git(repo, "rev-parse", "HEAD").strip()
    if not checkout:
        git(repo, "checkout", "-q", "main")
    return sha


def _ref(repo: Path, branch: str) -> str:
    return git(repo, "for-each-ref", "--format=%(objectname)", f"refs/heads/{branch}").strip()


def test_a_branch_the_user_made_is_never_overwritten(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    mine = _users_own_commit(repo, "agentbox/t-1")
    before = repo_state(repo)
    with pytest.raises(PublishRefused, match="agentbox did not write") as info:
        publish(p.shadow, repo, task_id="t-1", commit=commit)
    assert "agentbox publish t-1 --branch" in str(info.value)
    assert _ref(repo, "agentbox/t-1") == mine
    assert git(repo, "show", "agentbox/t-1:mine.txt") == "my own work\n"
    assert repo_state(repo) == before


def test_a_checked_out_branch_is_refused_and_published_under_another_name(
    repo: Path, tmp_path: Path
) -> None:
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    mine = _users_own_commit(repo, "agentbox/t-1", checkout=True)
    before = repo_state(repo)
    with pytest.raises(PublishRefused):
        publish(p.shadow, repo, task_id="t-1", commit=commit)
    assert _ref(repo, "agentbox/t-1") == mine and repo_state(repo) == before
    # The result was kept: published later under a name of the user's choice.
    assert publish(p.shadow, repo, task_id="t-1", commit=commit, branch="review/t-1") == (
        "review/t-1"
    )
    assert _ref(repo, "review/t-1") == commit
    assert git(repo, "show", "review/t-1:src/app.py") == "changed\n"
    after = repo_state(repo)
    assert after["refs"] == [*before["refs"], f"refs/heads/review/t-1 {commit}"]  # type: ignore[misc]
    assert {**after, "refs": None} == {**before, "refs": None}
    assert _ref(repo, "agentbox/t-1") == mine


def test_an_unborn_checked_out_branch_is_refused(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    git(repo, "checkout", "-q", "--orphan", "agentbox/t-1")  # HEAD names it; it has no commit
    with pytest.raises(PublishRefused, match="checked out"):
        publish(p.shadow, repo, task_id="t-1", commit=commit)
    assert _ref(repo, "agentbox/t-1") == ""


def test_a_symbolic_ref_is_refused_and_its_target_untouched(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    git(repo, "checkout", "-q", "-b", "work")
    main = _ref(repo, "main")
    git(repo, "symbolic-ref", "refs/heads/agentbox/t-1", "refs/heads/main")
    with pytest.raises(PublishRefused, match="symbolic ref"):
        publish(p.shadow, repo, task_id="t-1", commit=commit)
    assert _ref(repo, "main") == main


def test_agentbox_moves_only_what_it_wrote(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    record = tmp_path / "published.json"
    first = _result(p, "one\n")
    assert publish(p.shadow, repo, task_id="t-1", commit=first, record=record) == "agentbox/t-1"
    # Publishing the same result again changes nothing.
    assert publish(p.shadow, repo, task_id="t-1", commit=first, record=record) == "agentbox/t-1"
    assert _ref(repo, "agentbox/t-1") == first
    # A second collection of the task (a restarted launcher) may move agentbox's own
    # branch, but only with the record saying agentbox wrote what is there.
    second = _result(p, "two\n")
    with pytest.raises(PublishRefused):
        publish(p.shadow, repo, task_id="t-1", commit=second)
    assert _ref(repo, "agentbox/t-1") == first
    publish(p.shadow, repo, task_id="t-1", commit=second, record=record)
    assert _ref(repo, "agentbox/t-1") == second
    assert [e["commit"] for e in json.loads(record.read_text())] == [first, second]


def test_a_commit_made_while_publishing_is_kept(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compare-and-swap: the user creates the branch after it was read, before it is written."""
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    real = pub._remember
    made: list[str] = []

    def racing_user(*args: object, **kw: object) -> None:
        real(*args, **kw)  # type: ignore[arg-type]
        made.append(_users_own_commit(repo, "agentbox/t-1"))

    monkeypatch.setattr(pub, "_remember", racing_user)
    with pytest.raises(PublishRefused, match="changed while it was being published"):
        publish(p.shadow, repo, task_id="t-1", commit=commit, record=tmp_path / "rec.json")
    assert made and _ref(repo, "agentbox/t-1") == made[0]


@pytest.mark.parametrize(
    "name",
    ["-f", "a..b", "x.lock", "", "a b", "/abs", "a\nb", "@{-1}", "refs/../x", "x/",
     # names git reserves or reads as something else (issue 33 §7)
     "HEAD", "FETCH_HEAD", "ORIG_HEAD", "MERGE_HEAD", "AUTO_MERGE", "stash",
     "refs/heads/main", "0123456789abcdef"],
)  # fmt: skip
def test_bad_branch_names_are_refused(name: str, repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    before = git(repo, "for-each-ref")
    with pytest.raises(RefusedError):
        publish(p.shadow, repo, task_id="t-1", commit=commit, branch=name)
    assert git(repo, "for-each-ref") == before


# -- through the launcher and the CLI ------------------------------------------


def _finished_task(
    settings: Settings, tid: str, *, publish_: bool = True, mine: bool = False
) -> tuple[Path, str]:
    """A task run to the end through the launcher's own collect-and-publish step (what
    the sandbox would do stands in as: the agent edited a file). With ``mine``, the user
    has ``agentbox/<tid>`` with their own commit, checked out. Returns (repo, that commit)."""
    from agentbox.collect import prepare
    from agentbox.launcher import _finish, _runner
    from agentbox.launcher._context import TaskContext, TaskLog
    from agentbox.launcher._store import Store

    repo = make_repo(settings.repos_root / f"repo-{tid}", FILES)
    own = _users_own_commit(repo, f"agentbox/{tid}", checkout=True) if mine else ""
    paths = TaskPaths(settings.data_dir, tid)
    store = Store(settings.data_dir / "state.db")
    _runner._make_task_dir(paths)
    base = prepare(repo, paths.workspace, paths.shadow_git, paths.base_index)
    _finish.save_base(paths, base)
    (paths.workspace / "src/app.py").write_text("x = 2\n")
    store.insert(
        id=tid, status="running", repo=str(repo.resolve()), task="edit", model="replay-demo",
        budget=5, deadline=3600.0, created_at=time.time(), publish=int(publish_),
    )  # fmt: skip
    _finish.collect_and_finish(
        TaskContext(settings, store, paths, TaskLog(paths, store)), store.get(tid),
        status="done", error=None, exit_code=0,
    )  # fmt: skip
    return repo, own


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
    }
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_a_refused_branch_keeps_the_task_done_and_its_result(settings: Settings) -> None:
    tid = "t-pub"
    repo, mine = _finished_task(settings, tid, mine=True)
    launcher = Launcher(settings, max_tasks=1)
    try:
        info = launcher.get(tid)
        assert info.status == "done" and info.error is None
        assert info.branch is None and info.changed is True
        assert _ref(repo, f"agentbox/{tid}") == mine
        assert git(repo, "symbolic-ref", "HEAD").strip() == f"refs/heads/agentbox/{tid}"
        assert git(repo, "status", "--porcelain") == ""
        paths = TaskPaths(settings.data_dir, tid)
        report = json.loads(paths.report_file.read_text())
        assert report["status"] == "done" and report["branch"] is None
        assert any("agentbox did not write" in n["reason"] for n in report["notes"])
        assert "not published" in (paths.log_dir / "launcher.log").read_text()
        commit = launcher.store.get(tid).commit_id
        assert commit
        shown = _cli(settings, "show", tid, "--no-diff")
        assert shown.returncode == 0, shown.stderr
        assert f"(not published: agentbox/{tid} already exists" in " ".join(shown.stdout.split())

        # Publishing again under the same name is refused the same way ...
        with pytest.raises(PublishRefused):
            launcher.publish(tid)
        # ... and under another name it works; the store and the report say where.
        info = launcher.publish(tid, branch=f"agentbox/{tid}-2")
        assert info.branch == f"agentbox/{tid}-2" and info.status == "done"
        assert _ref(repo, f"agentbox/{tid}-2") == commit
        assert _ref(repo, f"agentbox/{tid}") == mine
        assert json.loads(paths.report_file.read_text())["branch"] == f"agentbox/{tid}-2"
        assert launcher.result(tid).branch == f"agentbox/{tid}-2"
    finally:
        launcher.close()


def test_cli_publishes_a_no_publish_task_later(settings: Settings) -> None:
    tid = "t-later"
    repo, _ = _finished_task(settings, tid, publish_=False)
    assert _ref(repo, f"agentbox/{tid}") == ""
    res = _cli(settings, "publish", tid)
    assert res.returncode == 0, res.stderr
    assert f"published agentbox/{tid}" in res.stdout
    commit = _ref(repo, f"agentbox/{tid}")
    assert commit and git(repo, "show", f"agentbox/{tid}:src/app.py") == "x = 2\n"
    # Again: already there, nothing to do.
    res = _cli(settings, "publish", tid, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["branch"] == f"agentbox/{tid}"
    # The user commits on it: agentbox never moves it again.
    git(repo, "checkout", "-q", f"agentbox/{tid}")
    (repo / "review.txt").write_text("ok\n")
    git(repo, "add", "review.txt")
    git(repo, "commit", "-q", "-m", "review")
    git(repo, "checkout", "-q", "main")
    mine = _ref(repo, f"agentbox/{tid}")
    res = _cli(settings, "publish", tid)
    assert res.returncode == 3 and "agentbox did not write" in " ".join(res.stderr.split())
    assert _ref(repo, f"agentbox/{tid}") == mine
    res = _cli(settings, "publish", tid, "--branch", "-x")
    assert res.returncode == 3


def test_cli_publish_refuses_what_has_no_result(settings: Settings) -> None:
    from agentbox.launcher._store import Store

    Store(settings.data_dir / "state.db").insert(
        id="t-run", status="running", repo=str(settings.repos_root), task="x",
        model="replay-demo", budget=5, deadline=3600.0, created_at=time.time(),
    )  # fmt: skip
    res = _cli(settings, "publish", "t-run")
    assert res.returncode == 1 and "not finished" in res.stderr
    res = _cli(settings, "publish", "t-none")
    assert res.returncode == 1 and "no such task" in res.stderr
    with pytest.raises(TaskError):
        Launcher(settings, max_tasks=1).publish("t-run")


# -- the MCP server's own fetch (``publish=False`` tasks, as the user) ----------


def test_mcp_fetch_never_overwrites_the_users_branch(repo: Path, tmp_path: Path) -> None:
    from agentbox.mcp import fetch_branch

    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    mine = _users_own_commit(repo, "agentbox/t-1")
    with pytest.raises(PublishRefused, match="agentbox did not write"):
        fetch_branch(repo, p.shadow, "t-1", commit)
    assert _ref(repo, "agentbox/t-1") == mine
    git(repo, "branch", "-D", "agentbox/t-1")
    # Free: fetched; again: nothing to do; the user's later commit is never replaced.
    assert fetch_branch(repo, p.shadow, "t-1", commit) == "agentbox/t-1"
    assert _ref(repo, "agentbox/t-1") == commit
    assert fetch_branch(repo, p.shadow, "t-1", commit) == "agentbox/t-1"
    git(repo, "update-ref", "refs/heads/agentbox/t-1", mine)
    with pytest.raises(PublishRefused):
        fetch_branch(repo, p.shadow, "t-1", commit)
    assert _ref(repo, "agentbox/t-1") == mine


def test_mcp_fetch_refuses_a_checked_out_branch(repo: Path, tmp_path: Path) -> None:
    from agentbox.mcp import fetch_branch

    p = prepare_in(tmp_path / "task", repo)
    commit = _result(p)
    git(repo, "checkout", "-q", "--orphan", "agentbox/t-1")
    with pytest.raises(PublishRefused, match="checked out"):
        fetch_branch(repo, p.shadow, "t-1", commit)
    assert _ref(repo, "agentbox/t-1") == ""
