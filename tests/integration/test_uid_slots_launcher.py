"""A uid range of its own per task sandbox, through the real launcher (issue 33 §9).

The launcher's code runs for real (store, workers, workspace copy and chown,
collection, reconcile); the sandbox is the in-process FakeBackend, which holds
uid slots as a real backend does. What is checked: two tasks that run at once
hold different slots and their workspaces belong to their own slot's uid; a slot
is free again when its task ends; a launcher that dies leaves a running task's
slot held, and the launcher that re-adopts the task keeps it and frees it at the end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fake_launcher
from agentbox.backends import _uidslots as slots
from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.launcher import Launcher, _runner
from fake_launcher import Frozen
from fake_launcher import dead_owner as _dead_owner
from fake_launcher import submit as _submit

fake, repo, _repo_template = fake_launcher.fake, fake_launcher.repo, fake_launcher._repo_template

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


def _tid(n: int) -> str:
    return f"t-uid{n:02d}-{os.getpid()}"


def test_two_running_tasks_hold_different_ranges_and_release_them(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    both_in = threading.Barrier(2, timeout=60)
    seen: dict[str, tuple[int, int | None]] = {}

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        assert box.spec.workspace is not None
        owner = box.spec.workspace.stat().st_uid
        seen[box.name] = (owner, slots.slot_of(settings, box.name))
        both_in.wait()  # both sandboxes live at once

    with (
        FakeBackend.scripted(FakeScript(action=agent)),
        Launcher(settings, max_tasks=2) as la,
    ):
        ids = [_tid(1), _tid(2)]
        for tid in ids:
            _submit(la, repo, tid)
        infos = [la.wait(t, timeout=60) for t in ids]
    assert [i.status for i in infos] == ["done", "done"], [i.error for i in infos]
    (uid_a, slot_a), (uid_b, slot_b) = seen.values()
    assert slot_a is not None and slot_b is not None and slot_a != slot_b
    assert uid_a == settings.for_slot(slot_a).sandbox_host_uid
    assert uid_b == settings.for_slot(slot_b).sandbox_host_uid
    assert settings.sandbox_host_uid not in (uid_a, uid_b)  # not the old shared range
    assert slots.held(settings) == {}  # both released when their tasks ended


@pytest.fixture
def freeze_follow(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, threading.Event]]:
    """The first launcher's worker stops for good when it starts following a task."""
    release = threading.Event()
    reached: dict[str, threading.Event] = {}
    real = _runner.follow_sandbox

    def follow(*a: Any, **kw: Any) -> Any:
        ev = reached.pop(a[0].task_id, None)
        if ev is not None:
            ev.set()
            release.wait(120)
            raise Frozen
        return real(*a, **kw)

    monkeypatch.setattr(_runner, "follow_sandbox", follow)
    yield reached
    release.set()


def test_a_readopted_task_keeps_its_range_and_frees_it_at_the_end(
    settings: Settings, fake: type[FakeBackend], repo: Path, freeze_follow: Any
) -> None:
    go = threading.Event()

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        go.wait(60)  # still working when its launcher dies
        box._write("after.txt", b"a\n")

    tid = _tid(3)
    name = f"agentbox-task-{tid}"
    la1 = Launcher(settings, max_tasks=1)
    with FakeBackend.scripted(FakeScript(action=agent)):
        freeze_follow[tid] = reached = threading.Event()
        _submit(la1, repo, tid)
        assert reached.wait(30)
        slot = slots.slot_of(settings, name)
        assert slot is not None
        ws = settings.data_dir / "tasks" / tid / "workspace"
        assert ws.stat().st_uid == settings.for_slot(slot).sandbox_host_uid
        la1.close(wait=False)
        _dead_owner(la1.store, tid)
        # A slot whose holder died and whose sandbox is gone: the reconcile frees it.
        stale = slots.claim(settings, "agentbox-task-gone")
        rec = slots.slots_dir(settings) / str(stale)
        rec.write_text(rec.read_text().replace(f'"pid": {os.getpid()}', '"pid": 1'))
        with Launcher(settings) as la2:
            assert tid in la2.reconcile()
            # Re-adopted: its live sandbox keeps the slot (no other sandbox gets it).
            assert slots.slot_of(settings, name) == slot
            assert slots.slot_of(settings, "agentbox-task-gone") is None
            assert slots.claim(settings, "agentbox-task-other") != slot
            slots.release(settings, "agentbox-task-other")
            go.set()
            info = la2.wait(tid, timeout=30)
    assert info.status == "done", info.error
    assert slots.slot_of(settings, name) is None  # released when the task ended
