"""A cancel ends its task whatever the sandbox's kill does at first (the CI flake of
``test_cancel_and_queue_limit_over_http``: a cancelled task ran on to its deadline).

The follower's monitor used to turn a cancel into *one* kill and stop watching: a kill
that did not land (refused by a busy runtime, timed out, or sent while the sandbox was
still being started) left the sandbox running, and the task with it, to its deadline.
Here the fake backend refuses the first kills, as a runtime under load can; the
monitor must keep killing until the sandbox ends, and the task end ``cancelled`` with
what the agent wrote collected.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import fake_launcher
from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.config import Settings
from agentbox.errors import AgentboxError, SandboxError
from agentbox.launcher import Launcher, _follow
from fake_launcher import submit as _submit
from fake_launcher import until as _until
from git_helpers import git

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)

#: The harness's fixtures (tests/fake_launcher.py), bound here so pytest finds them.
fake, repo, _repo_template = fake_launcher.fake, fake_launcher.repo, fake_launcher._repo_template


def test_a_cancel_whose_first_kills_are_refused_still_ends_the_task(
    settings: Settings, fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The monitor's repeats come sooner here (2 s, 5 s, 10 s in use): same order, same logic.
    monkeypatch.setattr(_follow, "KILL_AGAIN_AFTER", (0.2, 0.5, 1.0))
    refused: list[str] = []
    second_refusal = threading.Event()

    def busy(what: str) -> AgentboxError:
        refused.append(threading.current_thread().name)
        if len(refused) >= 2:
            second_refusal.set()
        return SandboxError(f"{what}: the runtime is busy", sandbox="-")

    tid = "cancelrace1"
    name = f"agentbox-task-{tid}"
    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(delay=120, files={"partial.txt": b"p\n"})),
    ):
        _submit(la, repo, tid)
        _until(lambda: FakeBackend.live(name) is not None)
        with FakeBackend.scripted(FakeScript(fail=frozenset({"kill"}), error=busy), name=name):
            la.cancel(tid)  # its own kill is refused (the first)
            # The follower's monitor sees the cancel and its kill is refused too.
            assert second_refusal.wait(30), f"the monitor never tried to kill: {refused}"
        # The runtime answers again: the cancel must still land, long before the
        # sandbox's own 120 s end.
        info = la.wait(tid, timeout=30)
        assert info.status == "cancelled", (info.status, info.error, refused)
        assert FakeBackend.live(name) is None
        result = la.result(tid)
    assert ("kill", name) in FakeBackend.events
    assert result.branch, result
    assert git(repo, "show", f"{result.branch}:partial.txt").strip() == "p"
