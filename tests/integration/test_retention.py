"""``agentbox rm``, ``prune`` and ``du`` on a real data dir, through the real CLI (issue 11.6).

The task dirs are made the way a finished task leaves them, with a workspace
the agent "wrote": links out of the data dir, a hard link to a host file, a
FIFO, an unreadable directory, a tree nested far deeper than the deleter holds
fds for. Removal must take all of the task and nothing outside it, refuse a
task that may still run, never touch the user's repo (its published branch
stays), and refuse to descend into a mount.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.launcher._retention import MAX_DEPTH, remove_tree
from agentbox.launcher._store import Store
from git_helpers import git

DAY = 86400.0


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        "AGENTBOX_CONFIG": "/nonexistent/agentbox.toml",
    }
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _task(
    settings: Settings,
    store: Store,
    task_id: str,
    *,
    status: str = "done",
    age: float = 10 * DAY,
    branch: str | None = None,
    changed: bool = True,
    outside: Path | None = None,
) -> Path:
    now = time.time()
    store.insert(
        id=task_id, status=status, repo="/nonexistent", task="t", model="replay-demo",
        budget=1000, deadline=60.0, created_at=now - age - 60,
        finished_at=None if status in ("queued", "running") else now - age,
        branch=branch, changed=int(changed),
    )  # fmt: skip
    root = settings.data_dir / "tasks" / task_id
    ws = root / "workspace"
    (ws / "src").mkdir(parents=True)
    (ws / "src/main.py").write_text("print('hi')\n" * 1000)
    (root / "shadow.git").mkdir()
    (root / "shadow.git/HEAD").write_text("ref: refs/heads/main\n")
    (root / "logs").mkdir()
    (root / "logs/launcher.log").write_text("log\n")
    (root / "report.json").write_text("{}")
    (root / "result.diff").write_text("diff\n")
    if outside is not None:
        (ws / "to-outside").symlink_to(outside)
        (ws / "to-outside-file").symlink_to(outside / "precious.txt")
        os.link(outside / "hardlinked.txt", ws / "hard.txt")
        os.mkfifo(ws / "fifo")
        locked = ws / "locked"
        locked.mkdir()
        (locked / "x").write_text("x")
        locked.chmod(0)
        deep = ws / "deep"
        deep.mkdir()
        fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(MAX_DEPTH * 6):  # deeper than PATH_MAX allows by name
            os.mkdir("d" * 40, dir_fd=fd)
            nfd = os.open("d" * 40, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(fd)
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious.txt").write_text("must survive\n")
    (d / "hardlinked.txt").write_text("must survive too\n")
    return d


@pytest.fixture
def store(settings: Settings) -> Store:
    return Store(settings.data_dir / "state.db")


def test_rm_removes_the_task_and_nothing_outside_it(
    settings: Settings, store: Store, outside: Path
) -> None:
    root = _task(settings, store, "t-hostile", outside=outside)
    res = _cli(settings, "rm", "t-hostile")
    assert res.returncode == 0, res.stderr
    assert "removed t-hostile" in res.stdout
    assert not root.exists()
    assert not store.exists("t-hostile")
    assert (outside / "precious.txt").read_text() == "must survive\n"
    assert (outside / "hardlinked.txt").read_text() == "must survive too\n"
    assert sorted(p.name for p in outside.iterdir()) == ["hardlinked.txt", "precious.txt"]


def test_rm_refuses_a_task_that_may_still_run(settings: Settings, store: Store) -> None:
    roots = [_task(settings, store, f"t-{s}", status=s) for s in ("queued", "running")]
    _task(settings, store, "t-collecting", status="collecting")
    res = _cli(settings, "rm", "t-queued", "t-running", "t-collecting")
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert res.stderr.count("only a finished task can be removed") == 3
    assert all((r / "workspace/src/main.py").exists() for r in roots)
    assert store.exists("t-running")


def test_rm_refuses_bad_ids_and_unknown_tasks(settings: Settings, store: Store) -> None:
    _task(settings, store, "t-ok")
    res = _cli(settings, "rm", "../tasks", "/etc", "t-missing", "t-ok")
    assert res.returncode == 1  # some refused, one removed
    assert res.stderr.count("not removed") == 3
    assert (settings.data_dir / "tasks").is_dir()
    assert not (settings.data_dir / "tasks/t-ok").exists()


def test_rm_never_touches_the_users_repo(settings: Settings, store: Store, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(
        repo,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@l",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    git(repo, "branch", "agentbox/t-published")
    _task(settings, store, "t-published", branch="agentbox/t-published")
    res = _cli(settings, "rm", "t-published")
    assert res.returncode == 0, res.stderr
    assert "branch agentbox/t-published (its result) stays in its repo" in res.stdout
    assert git(repo, "branch", "--list", "agentbox/t-published").strip()


def test_a_mount_inside_a_task_is_refused_not_emptied(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = _task(settings, store, "t-mounted")
    sub = root / "workspace/src"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(sub)], check=True)
    try:
        (sub / "on-the-mount").write_text("keep\n")
        with pytest.raises(Exception, match="mount point"):
            remove_tree(root.parent, root.name)
        assert (sub / "on-the-mount").read_text() == "keep\n"
    finally:
        subprocess.run(["umount", str(sub)], check=True)
    # A mounted workspace (a live or unsettled disk) is refused before the record goes.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root / "workspace")])
    try:
        res = _cli(settings, "rm", "t-mounted")
        assert res.returncode == 3 and "still mounted" in res.stderr
        assert store.exists("t-mounted")
    finally:
        subprocess.run(["umount", str(root / "workspace")], check=True)


def test_prune_by_age_keep_branches_and_dry_run(
    settings: Settings, store: Store, outside: Path
) -> None:
    old = _task(settings, store, "t-old", branch="agentbox/t-old", outside=outside)
    new = _task(settings, store, "t-new", age=DAY)
    kept = _task(settings, store, "t-unpublished", branch=None, changed=True)
    unchanged = _task(settings, store, "t-unchanged", branch=None, changed=False)
    running = _task(settings, store, "t-running-old", status="running", age=30 * DAY)
    orphan = settings.data_dir / "tasks/t-orphan"
    (orphan / "workspace").mkdir(parents=True)
    os.utime(orphan, (time.time() - 10 * DAY,) * 2)

    dry = _cli(settings, "prune", "--older-than", "7d", "--keep-branches", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove t-old" in dry.stdout and "would remove t-orphan" in dry.stdout
    assert all(p.exists() for p in (old, new, kept, unchanged, running, orphan))

    res = _cli(settings, "prune", "--older-than", "7d", "--keep-branches")
    assert res.returncode == 0, res.stderr
    assert not old.exists() and not store.exists("t-old")
    assert not unchanged.exists() and not orphan.exists()
    assert new.exists() and store.exists("t-new")  # too young
    assert running.exists() and store.exists("t-running-old")  # may still run
    # The unpublished result stays publishable: its shadow git dir, report and record.
    assert store.exists("t-unpublished")
    assert sorted(p.name for p in kept.iterdir()) == ["report.json", "result.diff", "shadow.git"]
    assert "kept its unpublished result" in res.stdout
    assert (outside / "precious.txt").exists()

    again = _cli(settings, "prune", "--older-than", "7d", "--keep-branches")
    assert "t-unpublished" not in again.stdout  # nothing left to do for it
    final = _cli(settings, "prune", "--older-than", "7d")
    assert "t-unpublished" in final.stdout and "unpublished result went with it" in final.stdout
    assert not kept.exists() and not store.exists("t-unpublished")


def test_prune_refuses_a_bad_age(settings: Settings) -> None:
    res = _cli(settings, "prune", "--older-than", "soon")
    assert res.returncode == 2 and "not an age" in res.stderr


def test_du_shows_what_the_data_dir_holds(settings: Settings, store: Store) -> None:
    _task(settings, store, "t-a")
    (settings.data_dir / "tasks/t-a/workspace/big.bin").write_bytes(os.urandom(1 << 20))
    (settings.data_dir / "tasks/t-lost/workspace").mkdir(parents=True)
    res = _cli(settings, "du", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    (task,) = data["tasks"]
    assert task["id"] == "t-a" and task["parts"]["workspace"] >= 1 << 20
    assert data["orphan_task_dirs"] == ["t-lost"]
    assert data["total"] >= task["total"] > 1 << 20
    text = _cli(settings, "du")
    assert text.returncode == 0 and "t-a" in text.stdout and "without a record" in text.stdout


def test_prune_removes_old_scratch_workspaces_only(settings: Settings, store: Store) -> None:
    scratch = settings.data_dir / "scratch"
    old, young = scratch / "ws-old", scratch / "ws-young"
    for d in (old, young):
        (d / "sub").mkdir(parents=True)
        (d / "sub/f").write_text("x")
    os.utime(old, (time.time() - 9 * DAY,) * 2)
    os.utime(young, (time.time() - 2 * DAY,) * 2)  # older than --older-than, but could be in use
    res = _cli(settings, "prune", "--older-than", "1d")
    assert res.returncode == 0, res.stderr
    assert "removed scratch/ws-old" in res.stdout
    assert not old.exists() and young.exists()


def _plan(settings: Settings, task_id: str, *, age: float) -> Path:
    """A continuation plan as ``resume``/``continue_from`` leaves it under ``continue/``."""
    where = settings.data_dir / "continue" / f"{task_id}.json"
    where.parent.mkdir(mode=0o700, exist_ok=True)
    doc = {"previous": "t-prev", "base_commit": "0" * 40, "previous_status": "done"}
    where.write_text(json.dumps(doc))
    os.utime(where, (time.time() - age,) * 2)
    return where


def test_rm_and_prune_take_continuation_plans_with_their_tasks(
    settings: Settings, store: Store
) -> None:
    _task(settings, store, "t-resumed")
    removed = _plan(settings, "t-resumed", age=10 * DAY)
    assert _cli(settings, "rm", "t-resumed").returncode == 0
    assert not removed.exists()

    _task(settings, store, "t-old-resumed")
    old = _plan(settings, "t-old-resumed", age=10 * DAY)
    stray = _plan(settings, "t-gone", age=10 * DAY)  # its task no longer exists
    young = _plan(settings, "t-submitting", age=60)  # a submit in progress
    _task(settings, store, "t-waiting", status="queued", age=30 * DAY)
    waiting = _plan(settings, "t-waiting", age=30 * DAY)  # still needed to run it
    outside = settings.data_dir.parent / "not-a-plan.json"
    outside.write_text("{}")
    (settings.data_dir / "continue" / "t-link.json").symlink_to(outside)

    dry = _cli(settings, "prune", "--older-than", "7d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "t-gone" in dry.stdout and stray.exists()
    res = _cli(settings, "prune", "--older-than", "7d")
    assert res.returncode == 0, res.stderr
    assert not old.exists() and not stray.exists()
    assert young.exists() and waiting.exists()
    assert outside.read_text() == "{}"  # a planted link is not followed


def test_a_groups_ledger_goes_with_its_last_attempt_and_prune_takes_strays(
    settings: Settings, store: Store
) -> None:
    """``groups/<id>`` (a best-of-N group's shared-budget ledger) stays while an attempt of
    the group is recorded, goes with the last one's ``rm``; ``prune`` takes an old one whose
    attempts are all gone, never a young one or one still used, and no link it finds."""
    groups = settings.data_dir / "groups"

    def group(name: str, age: float) -> Path:
        d = groups / name
        d.mkdir(parents=True)
        (d / "budget.json").write_text('{"budget": 1000}')
        os.utime(d, (time.time() - age, time.time() - age))
        return d

    ledger = group("grp", 10 * DAY)
    for k in (1, 2):
        _task(settings, store, f"grp-a{k}")
        store.update(f"grp-a{k}", group_id="grp", attempt=k)
    assert _cli(settings, "rm", "grp-a1").returncode == 0
    assert ledger.is_dir(), "removed while an attempt of its group is left"
    res = _cli(settings, "rm", "grp-a2")
    assert res.returncode == 0, res.stderr
    assert not ledger.exists()

    stray = group("gone", 10 * DAY)  # its attempts were removed by an older version
    young = group("making", 60)  # a group being submitted right now
    _task(settings, store, "used-a1", age=30 * DAY, status="queued")
    store.update("used-a1", group_id="used", attempt=1)
    used = group("used", 30 * DAY)
    outside = settings.data_dir.parent / "not-a-group"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (groups / "linked").symlink_to(outside)
    res = _cli(settings, "prune", "--older-than", "7d")
    assert res.returncode == 0, res.stderr
    assert not stray.exists() and young.is_dir() and used.is_dir()
    assert (outside / "keep.txt").read_text() == "keep"


def test_rm_says_what_went_and_what_stays_for_every_kind_of_task(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    """Issue 34 item 6: an MCP-delegated task (published=False by the launcher, its branch
    fetched into the repo by the MCP server, then merged) is not "lost"; a result that no
    branch holds is; a task that changed nothing says so."""
    repo = settings.repos_root / "proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    ident = ("-c", "user.name=t", "-c", "user.email=t@l")
    git(repo, *ident, "commit", "-q", "--allow-empty", "-m", "base")
    git(repo, *ident, "commit", "-q", "--allow-empty", "-m", "the agent's result")
    fetched = git(repo, "rev-parse", "HEAD").strip()  # merged into main, as a user would
    git(repo, "branch", "agentbox/t-mcp", fetched)
    git(repo, "branch", "-D", "agentbox/t-mcp")  # and deleted the branch after merging
    lost = "0" * 40  # a result commit the repo never received
    for tid, commit, changed in (("t-mcp", fetched, True), ("t-lost", lost, True),
                                 ("t-none", None, False)):  # fmt: skip
        _task(settings, store, tid, branch=None, changed=changed)
        store.update(tid, repo=str(repo), commit_id=commit)
    res = _cli(settings, "rm", "t-mcp", "t-lost", "t-none")
    assert res.returncode == 0, res.stderr
    lines = dict(ln.split(" ", 2)[1:] for ln in res.stdout.splitlines())
    assert "went with it" not in lines["t-mcp"], res.stdout
    assert f"main (its result, commit {fetched[:12]}) stays in its repo {repo}" in lines["t-mcp"]
    assert "its workspace, shadow git dir, logs and record" in lines["t-mcp"]
    assert "unpublished result went with it (commit 000000000000)" in lines["t-lost"]
    assert f"no branch of {repo} holds it" in lines["t-lost"]
    assert "changed nothing" in lines["t-none"] and "went with it" not in lines["t-none"]
