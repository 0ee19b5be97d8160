"""Live restore on the FakeBackend (issue 19): a launcher that dies loses no task.

The real launcher code runs (store, workers, workspace copy, shadow-git collection,
publishing into a real git repo); only the sandbox is the in-process
:class:`~agentbox.backends.fake.FakeBackend`, whose detached sandboxes a second
launcher can re-adopt, and the gateway a stand-in process whose command line is a
gateway's (so the launcher's pid + start time + command line check runs for real).

A launcher "dies" the way the existing reconcile test makes one die: its worker is
frozen (it never acts again) and the task's recorded owner becomes a process that
is gone; then a second :class:`Launcher` on the same data dir reconciles.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fake_launcher
from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.launcher import Launcher, _runner
from agentbox.launcher._store import SCHEMA_VERSION, Store
from fake_launcher import GATEWAYS, Frozen
from fake_launcher import dead_owner as _dead_owner
from fake_launcher import launches as _launches
from fake_launcher import submit as _submit
from fake_launcher import transcript as _transcript
from fake_launcher import until as _until
from git_helpers import git

#: The harness's fixtures (tests/fake_launcher.py), bound here so pytest finds them.
fake, repo, _repo_template = fake_launcher.fake, fake_launcher.repo, fake_launcher._repo_template

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


@pytest.fixture
def freezer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], threading.Event]]:
    """``freeze(where, task_id)``: the first launcher's worker stops for good at ``where``
    (``"follow"``: its sandbox runs detached; ``"prepare"``: while preparing) for that
    task; returns an event set once it got there. Released (``Frozen``) at the end."""
    release = threading.Event()
    frozen: dict[tuple[str, str], threading.Event] = {}
    real_follow, real_prepare = _runner.follow_sandbox, _runner.prepare_unsettled

    def freeze_here(where: str, task_id: str) -> None:
        reached = frozen.pop((where, task_id), None)
        if reached is not None:
            reached.set()
            release.wait(120)
            raise Frozen

    def follow(*a: Any, **kw: Any) -> Any:
        freeze_here("follow", a[0].task_id)  # a[0]: the TaskContext
        return real_follow(*a, **kw)

    def prepare(repo: Path, workspace: Path, *a: Any, **kw: Any) -> Any:
        freeze_here("prepare", workspace.parent.name)
        return real_prepare(repo, workspace, *a, **kw)

    monkeypatch.setattr(_runner, "follow_sandbox", follow)
    monkeypatch.setattr(_runner, "prepare_unsettled", prepare)

    def freeze(where: str, task_id: str) -> threading.Event:
        ev = threading.Event()
        frozen[(where, task_id)] = ev
        return ev

    yield freeze
    release.set()


def _new_id(n: int) -> str:
    return f"t-live{n:02d}-{os.getpid()}"


def test_a_running_task_is_readopted_and_finishes_done(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """Its sandbox goes on while no launcher follows it; the next launcher follows it
    from the start of its log, collects, publishes: done, the agent ran once."""
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        box._write("before.txt", b"b\n")
        go.wait(60)  # the agent is still working when its launcher dies
        box._write("after.txt", b"a\n")

    tid = _new_id(1)
    name = f"agentbox-task-{tid}"
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(stdout=b'{"type":"result","result":"ok"}\n',
                                         action=agent)):  # fmt: skip
        reached = freezer("follow", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        row = la1.store.get(tid)
        assert row.stage == "launched" and row.labels and row.labels["io.agentbox.task"] == tid
        assert row.watchdog_pid is None  # detached: no per-task watchdog
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            assert tid in la2.reconcile()
            go.set()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    row = la2.store.get(tid)
    assert row.adoptions == 1 and row.owner is not None and row.owner.pid == os.getpid()
    branch = la2.result(tid).branch
    assert git(repo, "show", f"{branch}:after.txt").strip() == "a"
    assert git(repo, "show", f"{branch}:before.txt").strip() == "b"
    assert _launches(name) == 1, FakeBackend.events  # never ran twice
    assert "re-adopted by launcher pid" in _transcript(settings, tid)
    out = (settings.data_dir / "tasks" / tid / "logs" / "agent.jsonl").read_bytes()
    assert out.count(b'"type":"result"') == 1  # the output whole, once
    assert not GATEWAYS[0].alive()  # the adopted gateway was stopped by the new launcher


def test_queued_and_preparing_tasks_run_under_the_next_launcher_in_order(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """Nothing of the agent ran: the partial task dir goes, and the tasks run again,
    each once, in submission order; none fails because its launcher changed."""
    first, second, third = _new_id(2), _new_id(3), _new_id(4)
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(files={"x.txt": b"x\n"})):
        reached = freezer("prepare", first)
        for tid in (first, second, third):
            _submit(la1, repo, tid)
        assert reached.wait(30)
        assert (settings.data_dir / "tasks" / first).is_dir()
        assert la1.store.get(first).stage == "preparing"
        assert la1.store.get(second).status == "queued"
        la1.close(wait=False)
        _dead_owner(la1.store, first, second, third)
        with Launcher(settings, max_tasks=1) as la2:
            assert set(la2.reconcile()) == {first, second, third}
            infos = [la2.wait(t, timeout=60) for t in (first, second, third)]
    assert [i.status for i in infos] == ["done"] * 3, [i.error for i in infos]
    starts = [i.started_at or 0.0 for i in infos]
    assert starts == sorted(starts)  # submission order
    for tid in (first, second, third):
        assert _launches(f"agentbox-task-{tid}") == 1


def test_a_reused_gateway_pid_is_refused_and_never_signalled(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """The recorded gateway pid now names an unrelated live process: the task is not
    re-adopted (settled as before, saying why) and that process is left alone."""
    tid = _new_id(5)
    la1 = Launcher(settings, max_tasks=1)
    unrelated = subprocess.Popen(["sleep", "600"], start_new_session=True)
    # Start times are kept in 10 ms ticks: the gateway, spawned as soon as the task is
    # submitted, must not start in the same tick, or the record would truly name it.
    time.sleep(0.1)
    try:
        with FakeBackend.scripted(FakeScript(delay=60, files={"p.txt": b"p\n"})):
            reached = freezer("follow", tid)
            _submit(la1, repo, tid)
            assert reached.wait(30)
            la1.close(wait=False)
            # A pid reused: the record names a live process that is not the gateway
            # (its start time and command line differ).
            la1.store.update(tid, gateway_pid=unrelated.pid,
                             gateway_start=la1.store.get(tid).gateway.start)  # type: ignore[union-attr]  # fmt: skip
            _dead_owner(la1.store, tid)
            with Launcher(settings) as la2:
                la2.reconcile()
                info = la2.wait(tid, timeout=30)
        assert info.status == "failed" and "interrupted" in (info.error or ""), info
        assert unrelated.poll() is None, "an unrelated process was signalled"
        assert "not re-adopted: pid" in _transcript(settings, tid)
        assert la2.store.get(tid).adoptions == 0
        assert la2.result(tid).branch  # the partial result is still collected
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_sandbox_of_another_data_dir_is_not_adopted(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """Right name, right task label, but the recorded labels name another data dir: the
    backend's adoptable() refuses and the task is settled, not followed."""
    tid = _new_id(6)
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(delay=60)):
        reached = freezer("follow", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        la1.close(wait=False)
        labels = dict(la1.store.get(tid).labels or {})
        la1.store.update(tid, labels={**labels, "io.agentbox.data": "0" * 16})
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            la2.reconcile()
            info = la2.wait(tid, timeout=30)
    assert info.status == "failed", info
    assert "not re-adopted: the recorded sandbox labels" in _transcript(settings, tid)
    assert ("follow", f"agentbox-task-{tid}") not in FakeBackend.events


#: The store's schema before versioning (version 1: main before live restore), verbatim.
V1_SCHEMA = """
CREATE TABLE tasks (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, repo TEXT NOT NULL, task TEXT NOT NULL,
    model TEXT NOT NULL, budget INTEGER NOT NULL, deadline REAL NOT NULL,
    include_uncommitted INTEGER NOT NULL DEFAULT 0, publish INTEGER NOT NULL DEFAULT 1,
    boxfile TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    exit_code INTEGER, tokens TEXT, branch TEXT, commit_id TEXT, error TEXT, sandbox TEXT,
    backend TEXT, owner_pid INTEGER, owner_start REAL, gateway_pid INTEGER,
    gateway_start REAL, watchdog_pid INTEGER, cancel_requested INTEGER NOT NULL DEFAULT 0,
    phase TEXT, changed INTEGER, caller_uid INTEGER
);
"""
#: What version 2 added (the live-restore columns), as a version-2 launcher wrote it.
V2_ALTER = [
    "ALTER TABLE tasks ADD COLUMN stage TEXT",
    "ALTER TABLE tasks ADD COLUMN runtime TEXT",
    "ALTER TABLE tasks ADD COLUMN labels TEXT",
    "ALTER TABLE tasks ADD COLUMN sandbox_log TEXT",
    "ALTER TABLE tasks ADD COLUMN deadline_at REAL",
    "ALTER TABLE tasks ADD COLUMN outcome TEXT",
    "PRAGMA user_version = 2",
]


def test_an_old_schema_is_migrated_and_its_running_task_adopted(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """A version-2 store (made with that version's SQL) holding a running detached task:
    the next version migrates it in place and re-adopts the task."""
    tid = _new_id(7)
    go = threading.Event()  # the agent works on until the next launcher has adopted it
    la1 = Launcher(settings, max_tasks=1)
    script = FakeScript(action=lambda box, argv: go.wait(60), files={"m.txt": b"m\n"})
    with FakeBackend.scripted(script), contextlib.ExitStack() as release:
        release.callback(go.set)
        reached = freezer("follow", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        # Rewrite the store as a version-2 launcher left it: its SQL, its columns.
        db_path = settings.data_dir / "state.db"
        old = _row_dict(db_path, tid)
        db_path.unlink()
        for side in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(f"{db_path}{side}").unlink()
        db = sqlite3.connect(db_path, isolation_level=None)
        db.execute(V1_SCHEMA)
        for sql in V2_ALTER:
            db.execute(sql)
        # Columns of later versions: adoptions (3), group_id and attempt (4).
        cols = [c for c in old if c not in ("adoptions", "group_id", "attempt")]
        db.execute(f"INSERT INTO tasks ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                   [old[c] for c in cols])  # fmt: skip
        db.close()
        with Launcher(settings) as la2:
            version = sqlite3.connect(db_path).execute("PRAGMA user_version").fetchone()[0]
            assert version == SCHEMA_VERSION
            assert tid in la2.reconcile()
            go.set()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    assert la2.store.get(tid).adoptions == 1
    assert (la2.store.get(tid).group_id, la2.store.get(tid).attempt) == (None, None)
    assert git(repo, "show", f"{la2.result(tid).branch}:m.txt").strip() == "m"


def _row_dict(db_path: Path, tid: str) -> dict[str, Any]:
    db = sqlite3.connect(db_path)
    db.row_factory = sqlite3.Row
    try:
        r = db.execute("SELECT * FROM tasks WHERE id = ?", (tid,)).fetchone()
        return {k: r[k] for k in r.keys()}  # noqa: SIM118
    finally:
        db.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db_path = tmp_path / "state.db"
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute(V1_SCHEMA)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    from agentbox.errors import ConfigError

    with pytest.raises(ConfigError, match="schema version"):
        Store(db_path)


def test_a_version_0_store_gains_every_column(tmp_path: Path) -> None:
    """A store from before the ad hoc columns (no phase/changed/caller_uid, no version)."""
    db_path = tmp_path / "state.db"
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute(V1_SCHEMA.replace(",\n    phase TEXT, changed INTEGER, caller_uid INTEGER", ""))
    db.execute("INSERT INTO tasks (id, status, repo, task, model, budget, deadline, created_at,"
               " sandbox, backend) VALUES ('t-old', 'running', '/r', 't', 'm', 1, 60, 1.0,"
               " 'agentbox-task-t-old', 'podman')")  # fmt: skip
    db.close()
    row = Store(db_path).get("t-old")
    assert row.stage == "attached"  # an old launcher's task ran attached: not adoptable
    assert row.caller_uid is None and row.adoptions == 0


def test_a_plain_stop_leaves_detached_tasks_running_and_queued_ones_queued(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    """``launcher stop`` (no --drain/--cancel): the running task's sandbox goes on, the
    queued one stays queued, and a new submit is refused; the next launcher runs both."""
    from agentbox.errors import RefusedError

    first, second = _new_id(8), _new_id(9)
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        go.wait(60)
        box._write("s.txt", b"s\n")

    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(action=agent)):
        _submit(la1, repo, first)
        _until(lambda: FakeBackend.live(f"agentbox-task-{first}") is not None)
        _submit(la1, repo, second)
        la1.stop("leave", grace=5)
        with pytest.raises(RefusedError, match="draining"):
            _submit(la1, repo, _new_id(10))
        assert la1.store.get(first).status == "running"
        assert la1.store.get(second).status == "queued"
        assert FakeBackend.live(f"agentbox-task-{first}") is not None  # not cancelled
        go.set()  # (in this process the stopped launcher's follower still sees it end)
        assert la1.wait(first, timeout=30).status == "done"
        for worker in la1._workers:  # each took its last item (``second``, left) and exited
            worker.join(30)
            assert not worker.is_alive()
        assert la1.store.get(second).status == "queued"  # never started by the stopped one
        _dead_owner(la1.store, second)
        with Launcher(settings, max_tasks=1) as la2:
            assert la2.reconcile() == [second]
            info = la2.wait(second, timeout=30)
    assert info.status == "done", info.error
    assert _launches(f"agentbox-task-{second}") == 1


def test_a_foreground_run_leaves_other_tasks_to_the_launcher_service(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """A foreground ``agentbox run`` reconciles without adopting (A5's finding): another
    dead launcher's running task and queued task are neither followed nor run by it
    (their sandbox and gateway are left running, their owner unclaimed), so its
    ``close()`` does not wait for them; the launcher service then takes both over."""
    running, queued = _new_id(11), _new_id(12)
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        go.wait(60)
        box._write("f.txt", b"f\n")

    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(action=agent)):
        reached = freezer("follow", running)
        _submit(la1, repo, running)
        assert reached.wait(30)
        _submit(la1, repo, queued)
        la1.close(wait=False)
        _dead_owner(la1.store, running, queued)
        dead = la1.store.get(running).owner
        fg = Launcher(settings)
        try:
            assert fg.reconcile(adopt=False) == []
            assert FakeBackend.live(f"agentbox-task-{running}") is not None  # not reaped
            assert GATEWAYS[0].alive()  # its gateway neither
            closing = threading.Thread(target=fg.close, daemon=True)
            closing.start()
            closing.join(30)  # the harness's bound: close waits for nothing of theirs
            assert not closing.is_alive(), "the foreground launcher waits for another's task"
        finally:
            go.set()
            fg.close()
        assert fg.store.get(running).owner == dead and fg.store.get(running).adoptions == 0
        assert fg.store.get(queued).status == "queued" and fg.store.get(queued).owner == dead
        with Launcher(settings, max_tasks=1) as service:
            assert set(service.reconcile()) == {running, queued}
            infos = [service.wait(t, timeout=30) for t in (running, queued)]
    assert [i.status for i in infos] == ["done", "done"], [i.error for i in infos]
    assert _launches(f"agentbox-task-{running}") == 1
    assert _launches(f"agentbox-task-{queued}") == 1
