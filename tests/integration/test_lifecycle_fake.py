"""The task lifecycle on the in-process FakeBackend: every status, in milliseconds.

The real launcher (store, worker threads, workspace copy, shadow-git collection,
publishing into a real repo, the watchdog process) runs here; only the sandbox
is :class:`~agentbox.backends.fake.FakeBackend` (scripted exit codes, files,
delays, failures) and the gateway a stand-in process that writes the usage
file the real one would. The end-to-end tests (``tests/e2e``) keep proving
that the real parts fit; these cover the logic: status transitions, cancel,
the deadline, an exhausted budget, reconcile after a crash, both publish paths.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fake_launcher
from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import SandboxError
from agentbox.gateway import GatewayHandle
from agentbox.gateway._usage import Usage, write_usage
from agentbox.launcher import Launcher, TaskRequest, _runner
from fake_launcher import until as _until
from git_helpers import git

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


class _Gateway(GatewayHandle):
    """A stand-in gateway: a real process in its own group (so the launcher's kill and
    stop paths run for real), a real socket, and the usage file the real one writes."""

    def __init__(self, *, socket_path: Path, usage_file: Path, model: str, budget: int) -> None:
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        super().__init__(proc, socket_path=socket_path, usage_file=usage_file, log_file=None)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(socket_path))
        write_usage(usage_file, Usage(model=model, budget=budget))

    def stop(self, grace: float = 5.0) -> int | None:
        self.listener.close()
        return super().stop(grace=min(grace, 1.0))


#: Every stand-in gateway the current test spawned: stopped (its socket closed) at the
#: end even when the launcher only killed its process, so no socket is left to the
#: garbage collector (a ResourceWarning that failed whichever test it landed in).
_GATEWAYS: list[_Gateway] = []


def _spawn_gateway(**kw: Any) -> GatewayHandle:
    gw = _Gateway(
        socket_path=kw["socket_path"],
        usage_file=kw["usage_file"],
        model=kw["model"],
        budget=kw["budget"],
    )
    _GATEWAYS.append(gw)
    return gw


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeBackend]]:
    """The fake as the default backend, the stand-in gateway; nothing live afterwards."""
    FakeBackend.reset()
    _GATEWAYS.clear()
    monkeypatch.setattr(_runner, "spawn_gateway", _spawn_gateway)
    with FakeBackend.installed_as("podman"):
        yield FakeBackend
    for gw in _GATEWAYS:
        gw.stop()
    _GATEWAYS.clear()
    assert FakeBackend.live_names() == [], "a fake sandbox survived its task"
    FakeBackend.reset()


#: One real repo made with git once per module, a copy per test (tests/fake_launcher.py).
repo, _repo_template = fake_launcher.repo, fake_launcher._repo_template


@pytest.fixture
def launcher(settings: Settings, fake: type[FakeBackend]) -> Iterator[Launcher]:
    with Launcher(settings, max_tasks=2) as la:
        yield la


def _submit(launcher: Launcher, repo: Path, **kw: Any) -> str:
    return launcher.submit(TaskRequest(repo=str(repo), task="do it", **kw)).id


def _branch_file(repo: Path, branch: str, path: str) -> str:
    return git(repo, "show", f"{branch}:{path}").strip()


def test_done_collects_and_publishes_the_branch(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript(files={"new.txt": b"made by the agent\n"})):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "done", info.error
    result = launcher.result(tid)
    assert result.branch, result
    assert _branch_file(repo, result.branch, "new.txt") == "made by the agent"
    assert ("launch", f"agentbox-task-{tid}") in FakeBackend.events
    assert ("follow", f"agentbox-task-{tid}") in FakeBackend.events


def test_the_agent_runs_claude_with_its_output_logged(launcher: Launcher, repo: Path) -> None:
    seen: list[Sequence[str]] = []

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        seen.append(list(argv))

    with FakeBackend.scripted(FakeScript(stdout=b'{"type":"result"}\n', action=agent)):
        tid = _submit(launcher, repo)
        launcher.wait(tid, timeout=30)
    assert seen and seen[0][0] == "claude" and seen[0][-1] == "do it"
    log = TaskPaths(launcher.settings.data_dir, tid).log_dir / "agent.jsonl"
    assert log.read_bytes() == b'{"type":"result"}\n'


def test_a_failing_agent_is_failed_but_still_collected(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript(exit_code=3, files={"half.txt": b"half\n"})):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "failed"
    assert "exited with code 3" in (info.error or "")
    result = launcher.result(tid)
    assert result.branch and _branch_file(repo, result.branch, "half.txt") == "half"


def test_no_changes_means_no_branch(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript()):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "done"
    assert not launcher.result(tid).branch


def test_a_sandbox_that_cannot_start_fails_the_task(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript(fail=frozenset({"launch"}))):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "failed"
    assert "scripted failure of launch" in (info.error or "")


def test_cancel_kills_the_sandbox_and_collects(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript(delay=60, files={"partial.txt": b"p\n"})):
        tid = _submit(launcher, repo)
        name = f"agentbox-task-{tid}"
        # The agent wrote its file (a cancel before the fake's exec began, as under load,
        # would kill a sandbox that never ran: nothing to collect).
        partial = TaskPaths(launcher.settings.data_dir, tid).workspace / "partial.txt"
        _until(lambda: FakeBackend.live(name) is not None and partial.exists())
        launcher.cancel(tid)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "cancelled"
    assert ("kill", name) in FakeBackend.events
    result = launcher.result(tid)
    assert result.branch and _branch_file(repo, result.branch, "partial.txt") == "p"


def test_cancel_before_it_runs(settings: Settings, fake: type[FakeBackend], repo: Path) -> None:
    with Launcher(settings, max_tasks=1) as la, FakeBackend.scripted(FakeScript(delay=60)):
        first = _submit(la, repo)
        second = _submit(la, repo)
        assert la.get(second).status == "queued"
        la.cancel(second)
        la.cancel(first)
        assert la.wait(second, timeout=30).status == "cancelled"
        assert la.wait(first, timeout=30).status == "cancelled"
    assert f"agentbox-task-{second}" not in {n for _, n in FakeBackend.events}


def test_the_deadline_times_the_task_out(launcher: Launcher, repo: Path) -> None:
    with FakeBackend.scripted(FakeScript(delay=120, files={"slow.txt": b"s\n"})):
        tid = _submit(launcher, repo, deadline=60)
        name = f"agentbox-task-{tid}"
        _until(lambda: FakeBackend.live(name) is not None)
        box = FakeBackend.live(name)
        assert box is not None and box.spec.deadline == 60
        box.advance(60)  # the fake's clock: a minute passes, no test waits for it
        info = launcher.wait(tid, timeout=30)
    assert info.status == "timed_out", info
    assert "deadline" in (info.error or "")
    result = launcher.result(tid)
    assert result.branch and _branch_file(repo, result.branch, "slow.txt") == "s"


def test_the_deadline_is_the_backends_own(settings: Settings, tmp_path: Path) -> None:
    """The fake enforces ``spec.deadline`` itself, as every backend must."""
    from agentbox.backends.base import SandboxSpec

    ws = tmp_path / "ws"
    ws.mkdir()
    spec = SandboxSpec(name="agentbox-fake-deadline", image="x", workspace=ws, deadline=0.05)
    with FakeBackend.scripted(FakeScript(delay=30)):
        res = FakeBackend(settings).run(spec, ["sleep"])
    assert res.timed_out and res.exit_code == 137
    assert FakeBackend.live_names() == []


def test_an_exhausted_budget_fails_the_task(launcher: Launcher, repo: Path) -> None:
    def spend(box: FakeSandbox, argv: Sequence[str]) -> None:
        tid = box.name.removeprefix("agentbox-task-")
        usage_file = TaskPaths(launcher.settings.data_dir, tid).usage_file
        write_usage(
            usage_file,
            Usage(budget=1000, input=1500, weighted_total=1500.0, exhausted=True),
        )

    with FakeBackend.scripted(FakeScript(action=spend, files={"part.txt": b"x\n"})):
        tid = _submit(launcher, repo, budget=1000)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "failed"
    assert "budget exhausted after 1,500 of 1,000 tokens" in (info.error or "")
    assert info.tokens is not None and info.tokens.input == 1500


def test_publish_false_keeps_the_result_for_the_mcp_server_to_fetch(
    launcher: Launcher, repo: Path
) -> None:
    """The second publish path: nothing lands in the repo until someone publishes."""
    with FakeBackend.scripted(FakeScript(files={"kept.txt": b"k\n"})):
        tid = _submit(launcher, repo, publish=False)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "done"
    branches = git(repo, "branch", "--list", "agentbox/*")
    assert tid not in branches
    published = launcher.publish(tid)
    branch = launcher.result(tid).branch
    assert published.status == "done" and branch
    assert _branch_file(repo, branch, "kept.txt") == "k"


def test_wait_wakes_when_the_task_ends_not_at_its_next_poll(
    launcher: Launcher, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task this launcher runs wakes its waiter as it ends: with an hour between two
    looks at the store, ``wait`` still returns (a wait that only polled would time out)."""
    import threading

    from agentbox.launcher import _core

    monkeypatch.setattr(_core, "WAIT_POLL", 3600.0)
    waiting = threading.Event()
    real = Launcher._wait_for_an_end

    def wait_for_an_end(self: Launcher, seen: int, timeout: float) -> None:
        waiting.set()  # the waiter looked once and saw the task running
        real(self, seen, timeout)

    monkeypatch.setattr(Launcher, "_wait_for_an_end", wait_for_an_end)
    with FakeBackend.scripted(FakeScript(action=lambda box, argv: waiting.wait(60))):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "done", info.error
    assert waiting.is_set()


def test_a_drain_stop_returns_once_queued_and_running_tasks_ended(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    la = Launcher(settings, max_tasks=1)

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        # The first agent works until the drain has begun (the second task still queued
        # behind it): no fixed delay to outlast, however slow the machine.
        _until(lambda: la.draining)

    with FakeBackend.scripted(FakeScript(action=agent, files={"d.txt": b"d\n"})):
        first, second = _submit(la, repo), _submit(la, repo)
        la.stop("drain")
    assert [la.get(t).status for t in (first, second)] == ["done", "done"]


def test_reconcile_after_a_crash_collects_and_marks(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    """A launcher that died mid-task: the next one reaps what is left, collects, marks."""
    import threading

    frozen = threading.Event()  # the dead launcher's worker: stuck until the test ends

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        box._write("before-crash.txt", b"c\n")
        frozen.wait(60)

    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(delay=60, action=agent)),
    ):
        try:
            tid = _submit(la, repo)
            name = f"agentbox-task-{tid}"
            # The agent wrote its file before the crash (its exec began: under load the
            # launch can return well before the fake's thread runs the agent).
            wrote = settings.data_dir / "tasks" / tid / "workspace" / "before-crash.txt"
            _until(lambda: wrote.exists() and FakeBackend.live(name) is not None)
            # The crash: the owner recorded for the task is now a process that is gone.
            dead = subprocess.Popen(["true"])
            dead.wait()
            la.store.update(tid, owner_pid=dead.pid, owner_start=1.0)
            with Launcher(settings) as next_one:
                settled = next_one.reconcile()
            assert tid in settled
            assert ("reap", name) in FakeBackend.events
            assert FakeBackend.live(name) is None
            info = la.get(tid)
            assert info.status == "failed", info
            result = next_one.result(tid)
            assert result.branch, result
            assert _branch_file(repo, result.branch, "before-crash.txt") == "c"
        finally:
            frozen.set()


def test_a_reconcile_with_the_docker_daemon_down_leaks_no_socket(
    settings: Settings, fake: type[FakeBackend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconcile lists the sandboxes of every backend, docker's too. With its daemon
    down (a socket that refuses, as while dockerd restarts) the refused connect's socket
    is closed, not left to the garbage collector: the docker SDK's connect dropped it,
    one per reconcile, and each failed whichever test it was collected in."""
    refusing = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(refusing))  # bound, never listening: every connect() is refused
        monkeypatch.setenv("DOCKER_HOST", f"unix://{refusing}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with Launcher(settings) as la:
                assert la.reconcile() == []
            gc.collect()  # the exception's cycles, and the socket they held
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []


def test_destroy_is_idempotent_and_verified(settings: Settings, tmp_path: Path) -> None:
    from agentbox.backends.base import SandboxSpec

    ws = tmp_path / "ws"
    ws.mkdir()
    spec = SandboxSpec(name="agentbox-fake-destroy", image="x", workspace=ws)
    box = FakeBackend(settings).create(spec)
    with pytest.raises(SandboxError, match="live"):
        FakeBackend(settings).create(spec)
    box.destroy()
    box.destroy()
    assert FakeBackend.live_names() == []
    with pytest.raises(SandboxError):
        box.exec(["true"])


def test_a_teardown_that_leaves_something_is_an_error(settings: Settings, tmp_path: Path) -> None:
    """Positive control of the verification: a sandbox still listed after teardown."""
    from agentbox.backends.base import SandboxSpec

    class Leaky(FakeSandbox):
        def _teardown(self) -> None:
            self.killed.set()  # ... and forgets to remove itself from the backend

    ws = tmp_path / "ws"
    ws.mkdir()
    spec = SandboxSpec(name="agentbox-fake-leaky", image="x", workspace=ws)
    be = FakeBackend(settings)
    box = be.create(spec)
    FakeBackend.forget(box)
    leaky = Leaky(be, spec, FakeScript())
    FakeBackend._live[spec.name] = leaky
    with pytest.raises(SandboxError, match="teardown left"):
        leaky.destroy()
    FakeBackend.reset()


def test_the_image_is_looked_up_beside_the_workspace_copy_before_the_launch(
    launcher: Launcher, repo: Path, settings: Settings
) -> None:
    """Backend.warm gets the image the sandbox will run, before the launch asks for it."""
    with FakeBackend.scripted(FakeScript(files={"a.txt": b"a\n"})):
        tid = _submit(launcher, repo)
        info = launcher.wait(tid, timeout=30)
    assert info.status == "done", info.error
    events = list(FakeBackend.events)
    assert ("warm", settings.image) in events, events
    assert events.index(("warm", settings.image)) < events.index(("launch", f"agentbox-task-{tid}"))


def test_a_failing_warm_up_never_fails_the_task(
    launcher: Launcher, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def warm(self: FakeBackend, image: str) -> None:
        raise OSError("podman is not answering")

    monkeypatch.setattr(FakeBackend, "warm", warm)
    with FakeBackend.scripted(FakeScript(files={"a.txt": b"a\n"})):
        info = launcher.wait(_submit(launcher, repo), timeout=30)
    assert info.status == "done", info.error
