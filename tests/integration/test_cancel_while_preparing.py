"""A cancel that lands while a worker is preparing its task (M2).

A worker takes a task (stage ``preparing``) long before its status leaves
``queued``: the workspace is copied, the gateway spawned, the setup run, all
under ``queued``. A cancel used to flip any ``queued`` row straight to a terminal
``cancelled``, so while the worker went on preparing (and later collected and
wrote the report) a ``wait()`` caller already had a terminal task with no report.

Now a task no worker took is cancelled at once, as before; one a worker took is
cancelled through the worker, which stops at its next step and records
``cancelled`` only once what exists is collected and the report is written.
Here the worker is held inside ``prepare`` (the real copy, then an Event) on the
FakeBackend; no timing is assumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fake_launcher
from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.launcher import Launcher, _runner
from agentbox.launcher.api import TaskInfo
from fake_launcher import launches
from fake_launcher import submit as _submit
from git_helpers import git

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)

#: The harness's fixtures (tests/fake_launcher.py), bound here so pytest finds them.
fake, repo, _repo_template = fake_launcher.fake, fake_launcher.repo, fake_launcher._repo_template


class _Held:
    """A step of the worker (``prepare_unsettled``: the real copy; ``agent_argv``: the last step
    before the launch) as it calls it: the real one, then held until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, step: str = "prepare_unsettled") -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = getattr(_runner, step)

        def held(*args: Any, **kw: Any) -> Any:
            got = real(*args, **kw)
            self.entered.set()
            assert self.release.wait(60), f"the test never released {step}"
            return got

        monkeypatch.setattr(_runner, step, held)


@contextlib.contextmanager
def _released(held: _Held) -> Iterator[None]:
    """Whatever the test asserts, the held worker goes on (no worker left waiting)."""
    try:
        yield
    finally:
        held.release.set()


def _refs(repo: Path) -> str:
    return git(repo, "for-each-ref", "--format=%(refname) %(objectname)")


def _cancel_while_held(
    settings: Settings,
    repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    tid: str,
    *,
    other: bool,
    step: str = "prepare_unsettled",
) -> None:
    held = _Held(monkeypatch, step)
    name = f"agentbox-task-{tid}"
    refs = _refs(repo)
    seen: dict[str, object] = {}
    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(delay=60)),
        _released(held),
    ):
        _submit(la, repo, tid)
        assert held.entered.wait(30), "the worker never reached prepare"
        if other:
            # Another launcher on the same store (as another process would be): it has no
            # event for this task; the flag in the store is all the worker gets.
            with Launcher(settings, max_tasks=1) as la2:
                info = la2.cancel(tid)
        else:
            info = la.cancel(tid)
        # The worker holds the task: the cancel goes through it, nothing terminal yet.
        assert info.status == "queued", (info.status, info.error)
        assert la.get(tid).status == "queued"

        def waiter() -> None:
            got: TaskInfo = la.wait(tid, timeout=60)
            seen["info"] = got
            seen["report"] = TaskPaths(settings.data_dir, tid).report_file.exists()
            seen["launches"] = launches(name)

        w = threading.Thread(target=waiter)
        w.start()
        held.release.set()
        w.join(90)
        assert not w.is_alive()
        result = la.result(tid)
    got = seen["info"]
    assert isinstance(got, TaskInfo) and got.status == "cancelled", got
    # When wait() returned, the report was already written, and no sandbox ever started.
    assert seen["report"] is True and seen["launches"] == 0
    assert launches(name) == 0 and FakeBackend.live_names() == []
    assert result.report.get("status") == "cancelled", result.report
    report = json.loads(TaskPaths(settings.data_dir, tid).report_file.read_text())
    assert report["status"] == "cancelled" and report["agent_ran"] is False
    # The gateway spawned before the cancel is stopped; none was spawned after it.
    assert len(fake_launcher.GATEWAYS) == 1
    assert not fake_launcher.GATEWAYS[0].alive()
    # The user's repo: no branch, nothing moved.
    assert not result.branch
    assert _refs(repo) == refs
    assert git(repo, "status", "--porcelain") == ""


def test_cancel_while_the_worker_prepares_ends_through_the_worker(
    settings: Settings, fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cancel_while_held(settings, repo, monkeypatch, "prepcancel1", other=False)


def test_cancel_from_another_launcher_while_preparing(
    settings: Settings, fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cancel_while_held(settings, repo, monkeypatch, "prepcancel2", other=True)


def test_cancel_just_before_the_launch_starts_no_sandbox(
    settings: Settings, fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the last check before the launch (the gateway up, the spec built): the
    # worker's compare-and-set to running is followed by a look at the cancel.
    _cancel_while_held(settings, repo, monkeypatch, "prepcancel3", other=False, step="agent_argv")


def test_cancel_of_a_task_queued_behind_another_is_immediate(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    with Launcher(settings, max_tasks=1) as la, FakeBackend.scripted(FakeScript(delay=60)):
        first = _submit(la, repo, "runsfirst1")
        second = _submit(la, repo, "behind1")
        assert la.get(second).status == "queued"
        info = la.cancel(second)
        assert info.status == "cancelled"  # at once: no worker took it
        assert info.error == "cancelled before it started"
        assert la.cancel(second).status == "cancelled"  # idempotent
        la.cancel(first)
        assert la.wait(first, timeout=30).status == "cancelled"
    assert launches(f"agentbox-task-{second}") == 0
    assert not TaskPaths(settings.data_dir, second).root.exists()
