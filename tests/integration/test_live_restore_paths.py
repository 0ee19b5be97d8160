"""Live restore paths, on the FakeBackend.

* a launcher dies while its task is ``collecting``: the next one collects it again,
  exactly once, and publishes (before or after the dead one's publish);
* a launcher dies between recording the launch and the sandbox existing: the next
  one queues it again (nothing of the agent ran) and it runs once; and when the
  sandbox did start, the next one re-adopts it, never launching it twice;
* the gateway handshake (``gateway.json``): a gateway of the current version is
  re-adopted, one of a newer version or none is refused (the task settled, saying why).

The real launcher code runs (store, workers, shadow-git collection, publishing into
a real git repo); the sandbox is the in-process FakeBackend and the gateway a
stand-in process whose command line is a gateway's. A launcher "dies" as in
``test_live_restore_fake.py``: its worker is frozen at a chosen point for good and
its tasks' recorded owner becomes a process that is gone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fake_launcher
from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.gateway._handshake import HANDSHAKE_VERSION
from agentbox.launcher import Launcher, _finish
from fake_launcher import GATEWAYS, HANDSHAKE, Frozen
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
    """``freeze(where, task_id)``: the first launcher's worker stops for good at
    ``where`` for that task and the returned event is set. Points: ``launch`` (the
    launch recorded, the sandbox not made), ``launched`` (the sandbox started, not
    followed), ``publish`` (collecting, before publishing), ``published`` (collecting,
    published, not marked done). Released (``Frozen``) at the end."""
    release = threading.Event()
    frozen: dict[tuple[str, str], threading.Event] = {}
    calls: dict[str, int] = {}
    real_launch, real_publish = FakeBackend.launch, _finish.publish

    def freeze_here(where: str, task_id: str) -> None:
        reached = frozen.pop((where, task_id), None)
        if reached is not None:
            reached.set()
            release.wait(120)
            raise Frozen

    def launch(self: FakeBackend, spec: Any, argv: Sequence[str], *, log: Path) -> None:
        tid = spec.name.removeprefix("agentbox-task-")
        freeze_here("launch", tid)
        real_launch(self, spec, argv, log=log)
        freeze_here("launched", tid)

    def publish(*a: Any, task_id: str, **kw: Any) -> str:
        freeze_here("publish", task_id)
        branch = real_publish(*a, task_id=task_id, **kw)
        calls[task_id] = calls.get(task_id, 0) + 1
        freeze_here("published", task_id)
        return branch

    monkeypatch.setattr(FakeBackend, "launch", launch)
    monkeypatch.setattr(_finish, "publish", publish)

    def freeze(where: str, task_id: str) -> threading.Event:
        ev = threading.Event()
        frozen[(where, task_id)] = ev
        return ev

    freeze.publishes = calls  # type: ignore[attr-defined]
    yield freeze
    release.set()


def _new_id(n: int) -> str:
    return f"t-paths{n:02d}-{os.getpid()}"


@pytest.mark.parametrize("where", ["publish", "published"])
def test_a_launcher_that_dies_collecting_is_collected_again_once(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any, where: str
) -> None:
    """Caught ``collecting`` (before or after its publish): the next launcher collects
    with the recorded outcome, publishes once, and the branch holds one commit of the
    agent's work; the agent never runs again."""
    tid = _new_id(1 if where == "publish" else 2)
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(files={"work.txt": b"w\n"})):
        reached = freezer(where, tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        assert la1.store.get(tid).status == "collecting"
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            assert tid in la2.reconcile()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    branch = la2.result(tid).branch
    assert branch == f"agentbox/{tid}"
    assert git(repo, "show", f"{branch}:work.txt") == "w\n"
    assert git(repo, "rev-list", "--count", f"main..{branch}").strip() == "1"
    # The dead launcher's publish (if it got that far) plus the next one's: one each.
    assert freezer.publishes[tid] == (1 if where == "publish" else 2)
    assert _transcript(settings, tid).count("collected again by launcher pid") == 1
    assert _launches(f"agentbox-task-{tid}") == 1


def test_a_launcher_that_dies_before_the_sandbox_exists_has_it_queued_again(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """The launch is recorded (running, stage launched) but the launcher dies before
    the sandbox exists: nothing of the agent ran, so the next launcher queues it
    again; it runs once and is done."""
    tid = _new_id(3)
    name = f"agentbox-task-{tid}"
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(files={"work.txt": b"w\n"})):
        reached = freezer("launch", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        row = la1.store.get(tid)
        assert (row.status, row.stage) == ("running", "launched")
        assert _launches(name) == 0
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            assert tid in la2.reconcile()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    assert git(repo, "show", f"{la2.result(tid).branch}:work.txt") == "w\n"
    assert _launches(name) == 1
    assert la2.store.get(tid).adoptions == 0
    assert all(not gw.alive() for gw in GATEWAYS)  # the dead launcher's gateway too


def test_a_launcher_that_dies_right_after_the_launch_has_it_adopted_not_rerun(
    settings: Settings, fake: type[FakeBackend], repo: Path, freezer: Any
) -> None:
    """The sandbox started and the launcher died before following it: re-adopted and
    followed to its end; it is never launched a second time."""
    tid = _new_id(4)
    name = f"agentbox-task-{tid}"
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        go.wait(60)
        box._write("work.txt", b"w\n")

    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(stdout=b'{"type":"result","result":"ok"}\n',
                                         action=agent)):  # fmt: skip
        reached = freezer("launched", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            assert tid in la2.reconcile()
            go.set()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    assert la2.store.get(tid).adoptions == 1
    assert _launches(name) == 1
    assert git(repo, "show", f"{la2.result(tid).branch}:work.txt") == "w\n"


@pytest.mark.parametrize(
    ("version", "adopted"),
    [(HANDSHAKE_VERSION, True), (None, False), (HANDSHAKE_VERSION + 1, False)],
    ids=["current", "none", "newer"],
)
def test_a_gateway_is_adopted_by_its_handshake_version(
    settings: Settings,
    fake: type[FakeBackend],
    repo: Path,
    freezer: Any,
    version: int | None,
    adopted: bool,
) -> None:
    """A running task whose gateway speaks this launcher's handshake is re-adopted; a
    gateway of a newer version, or one that wrote no handshake, is refused: the task is
    settled (partial result collected) with the reason in its transcript."""
    tid = _new_id(5 + (version or 0))
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        box._write("work.txt", b"w\n")
        go.wait(60)

    HANDSHAKE["v"] = version
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(stdout=b'{"type":"result","result":"ok"}\n',
                                         action=agent)):  # fmt: skip
        reached = freezer("launched", tid)
        _submit(la1, repo, tid)
        assert reached.wait(30)
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        with Launcher(settings) as la2:
            la2.reconcile()
            go.set()
            info = la2.wait(tid, timeout=30)
    log = _transcript(settings, tid)
    if adopted:
        assert info.status == "done", info.error
        assert la2.store.get(tid).adoptions == 1
    else:
        assert info.status == "failed" and "interrupted" in (info.error or ""), info
        assert la2.store.get(tid).adoptions == 0
        why = (
            "wrote no handshake"
            if version is None
            else f"speaks handshake version {version}, newer than this launcher's"
        )
        assert why in log, log
        _until(lambda: not GATEWAYS[0].alive())  # settled: its gateway stopped too
    assert git(repo, "show", f"{la2.result(tid).branch}:work.txt") == "w\n"
    assert _launches(f"agentbox-task-{tid}") == 1
