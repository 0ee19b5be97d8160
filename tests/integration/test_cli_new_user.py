"""Issue 13 section 4: what a new user tripped over in the CLI, through the real CLI.

Tasks are made by the real launcher on the in-process FakeBackend (the sandbox is
the only fake part); the CLI then runs as its own process (``python -m agentbox``)
on the same data dir, piped, as a script or CI log would see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.config import Settings
from agentbox.core.wait import wait_until
from agentbox.launcher import Launcher, TaskRequest, _runner
from git_helpers import git

sys.path.insert(0, str(Path(__file__).parent))
from test_lifecycle_fake import _spawn_gateway

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


def _cli(settings: Settings, *args: str, stdin: str | None = None, cols: int = 80) -> Any:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
        "COLUMNS": str(cols),
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeBackend]]:
    FakeBackend.reset()
    monkeypatch.setattr(_runner, "spawn_gateway", _spawn_gateway)
    with FakeBackend.installed_as("podman"):
        yield FakeBackend
    assert FakeBackend.live_names() == []
    FakeBackend.reset()


@pytest.fixture
def repo(settings: Settings) -> Path:
    path = settings.repos_root / "proj"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def _done_task(settings: Settings, repo: Path, task: str = "do it", **script: Any) -> str:
    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(**(script or {"files": {"a.txt": b"a\n"}}))),
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task=task)).id
        la.wait(tid, timeout=30)
    return tid


# -- cancel, --json errors, --help -----------------------------------------------------


@needs_root
def test_cancel_a_finished_task_says_so_and_fails(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    tid = _done_task(settings, repo)
    r = _cli(settings, "cancel", tid)
    assert r.returncode == 1, r
    assert "had already finished (done)" in r.stderr


@needs_root
def test_cancel_of_a_running_task_says_it_is_cancelling(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(delay=60.0, files={"a.txt": b"a\n"})),
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="slow")).id
        wait_until(  # the launch, however slow the host: not a timing assertion
            lambda: la.get(tid).status == "running",
            timeout=120,
            on_timeout=lambda: AssertionError(f"never running: {la.get(tid)}"),
        )
        r = _cli(settings, "cancel", tid)
        info = la.wait(tid, timeout=60)
    assert r.returncode == 0, r
    # The launcher serving the task may stop it and record the end before the CLI's cancel
    # returns (the fake sandbox stops at once): then the CLI says it ended, and what it was.
    assert r.stdout.strip() in (
        f"{tid}: cancelling (was running); agentbox wait {tid} for its end",
        f"{tid}: cancelled (was running)",
    ), r.stdout
    assert info.status == "cancelled"


def test_json_errors_are_json(settings: Settings) -> None:
    r = _cli(settings, "show", "t-000000000000", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout) == {
        "error": "task_not_found",
        "message": "task t-000000000000: no such task",
    }
    r = _cli(settings, "show", "--json")  # a usage error too
    assert r.returncode == 2 and json.loads(r.stdout)["error"] == "missing_parameter"
    assert "task_id" in json.loads(r.stdout)["message"]


def test_help_shows_flags_as_flags(settings: Settings) -> None:
    out = _cli(settings, "tasks", "--help", cols=100).stdout
    assert "--json" in out and "--status" in out
    assert "<bool>" not in out
    assert "<str>" in out  # options that take a value still show its type


# -- run reads the task from a file or stdin ---------------------------------------------


@needs_root
def test_run_reads_the_task_from_stdin_and_a_file(
    settings: Settings, repo: Path, tmp_path: Path
) -> None:
    """No sandbox needed: an unknown model is refused after the task was read, so the
    refusal shows the task made it; a missing task is a usage error naming the ways."""
    r = _cli(settings, "run", "--repo", str(repo), "-", "--model", "nope", stdin="")
    assert r.returncode == 2 and "empty" in r.stderr
    r = _cli(settings, "run", "--repo", str(repo))
    assert r.returncode == 2 and "--task-file" in r.stderr
    f = tmp_path / "task.md"
    f.write_text("Fix the bug\n\nin detail\n")
    for args, stdin in (
        (["--task-file", str(f)], None),
        (["--task-file", "-"], "Fix the bug"),
        (["-"], "Fix the bug"),
    ):
        r = _cli(settings, "run", "--repo", str(repo), "--model", "nope", *args, stdin=stdin)
        assert r.returncode == 3 and "unknown model 'nope'" in r.stderr, (args, r)


# -- tables ---------------------------------------------------------------------------


@needs_root
def test_tasks_table_never_cuts_the_id_and_filters(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    other = settings.repos_root / "other"
    other.mkdir()
    git(other, "init", "-q", "-b", "main")
    (other / "x").write_text("x\n")
    git(other, "add", "-A")
    git(other, "commit", "-q", "-m", "x")
    long_task = "refactor the whole parser module so that every function is pure " * 3
    a = _done_task(settings, repo, long_task)
    b = _done_task(settings, other, "fail please", exit_code=3)
    for cols in (40, 80, 200):
        r = _cli(settings, "tasks", cols=cols)
        assert r.returncode == 0, r
        lines = r.stdout.splitlines()
        assert any(a in ln for ln in lines) and any(b in ln for ln in lines), (cols, r.stdout)
        assert all(ln == ln.rstrip() for ln in lines), "trailing padding on a pipe"
        if cols == 80:
            assert all(len(ln) <= 80 for ln in lines), r.stdout
            assert "repo" in lines[1] and "created" in lines[1], r.stdout
    only = _cli(settings, "tasks", "--repo", "other").stdout
    assert b in only and a not in only
    only = _cli(settings, "tasks", "--repo", str(repo)).stdout
    assert a in only and b not in only
    failed = _cli(settings, "tasks", "--status", "failed", "--json").stdout
    assert [t["id"] for t in json.loads(failed)["tasks"]] == [b]
    bad = _cli(settings, "tasks", "--status", "bogus")
    assert bad.returncode == 2 and "not a status" in bad.stderr


# -- the commit subject --------------------------------------------------------------


def test_commit_subject_is_a_short_summary() -> None:
    from agentbox.launcher._finish import commit_subject

    task = "Add a slugify helper with a unit test, and run the tests afterwards please"
    s = commit_subject("t-0123456789ab", task)
    assert len(s) <= 72 and s.endswith("…")
    assert s.removesuffix("…").split()[-1] in task.split()  # cut between words
    assert commit_subject("t-0123456789ab", "\n\n  short  \n") == "agentbox t-0123456789ab: short"


@needs_root
def test_commit_has_the_full_task_in_its_body(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    task = "Rename every helper in utils.py to snake_case and update their callers too\n\nkeep API"
    tid = _done_task(settings, repo, task)
    msg = git(repo, "log", "-1", "--format=%B", f"agentbox/{tid}")
    subject, _, body = msg.partition("\n")
    assert len(subject) <= 72 and subject.endswith("…")
    assert task in body


# -- failures before the agent, and the budget, are said as such --------------------------


@needs_root
def test_a_failure_before_the_agent_is_not_no_changes(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    tid = _done_task(settings, repo, fail=frozenset({"launch"}))
    r = _cli(settings, "show", tid)
    assert r.returncode == 0, r
    assert "no changes" not in r.stdout and "the agent never started" in r.stdout, r.stdout
    assert "scripted failure of launch" in r.stdout
    rep = json.loads(_cli(settings, "show", tid, "--json").stdout)
    assert rep["task"]["changed"] is None and rep["result"]["report"]["agent_ran"] is False


@needs_root
def test_budget_refusal_is_said_not_no_changes(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    from agentbox.backends.fake import FakeSandbox
    from agentbox.core.paths import TaskPaths
    from agentbox.gateway._usage import Usage, write_usage

    def refused(box: FakeSandbox, argv: object) -> None:
        # What the gateway writes when it refused the first call (nothing charged).
        tid = box.name.removeprefix("agentbox-task-")
        usage = Usage(budget=10_000, refusals={"over_budget": 1}, exhausted=True)
        write_usage(TaskPaths(settings.data_dir, tid).usage_file, usage)

    tid = _done_task(settings, repo, action=refused)
    r = _cli(settings, "show", tid)
    assert "budget exhausted after 0 of 10,000 tokens" in r.stdout, r.stdout
    assert "no changes" not in r.stdout
    log = (TaskPaths(settings.data_dir, tid).log_dir / "launcher.log").read_text()
    assert "budget exhausted after" in log and "no changes" not in log, log


@needs_root
def test_tasks_lists_live_tokens_of_a_running_task(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    from agentbox.backends.fake import FakeSandbox
    from agentbox.core.paths import TaskPaths
    from agentbox.gateway._usage import Usage, write_usage

    def spend(box: FakeSandbox, argv: object) -> None:
        tid = box.name.removeprefix("agentbox-task-")
        usage = Usage(budget=1_000_000, input=1234, output=56, weighted_total=1290.0)
        write_usage(TaskPaths(settings.data_dir, tid).usage_file, usage)

    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(action=spend, delay=60)),
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="slow")).id
        end = time.monotonic() + 20
        while la.get(tid).tokens.total == 0 and time.monotonic() < end:
            time.sleep(0.02)
        listed = {i.id: i for i in la.list()}[tid]
        assert listed.status == "running" and listed.tokens.total == 1290
        shown = _cli(settings, "tasks").stdout
        la.cancel(tid)
        la.wait(tid, timeout=30)
    assert "1,290" in shown, shown


# -- errors that name a setting give its environment variable and format -------------------


@needs_root
def test_errors_name_the_setting_env_var(settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    git(outside, "init", "-q")
    r = _cli(settings, "run", "--repo", str(outside), "x")
    assert r.returncode == 3 and "AGENTBOX_REPOS_ROOT" in r.stderr, r.stderr
    box = tmp_path / "Boxfile.toml"
    box.write_text(f'[[mounts]]\nsource = "{tmp_path}"\ntarget = "/opt/x"\n')
    repo = settings.repos_root / "p"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "f").write_text("f\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "f")
    r = _cli(settings, "run", "--repo", str(repo), "--boxfile", str(box), "x")
    err = " ".join(r.stderr.split())
    assert r.returncode == 3 and "AGENTBOX_MOUNT_ROOTS, a colon-separated list" in err, err


def test_mcp_says_no_changes_only_for_a_finished_task() -> None:
    from agentbox.launcher.api import NO_CHANGES, TaskInfo
    from agentbox.mcp._server import _info_dict

    base = {"id": "t-000000000001", "repo": "/r", "task": "x", "model": "m", "budget": 10,
            "deadline": 60.0, "created_at": 1.0, "changed": False}  # fmt: skip
    failed = TaskInfo(status="failed", error="budget exhausted after 0 of 10 tokens", **base)
    assert "outcome" not in _info_dict(failed)
    assert _info_dict(TaskInfo(status="done", **base))["outcome"] == NO_CHANGES
