"""A task's gateway starts beside its sandbox, not before it (issue 15 item 2).

The launcher binds the gateway's socket itself and hands it to the gateway process,
so the sandbox may start while the gateway (a Python process, 0.5-1 s) is still
starting; a connection made meanwhile waits in the socket's backlog. Real parts:
the real gateway process (``spawn_gateway``: its own uid, seccomp, the inherited
socket), the real launcher, store, workspace copy and collection; only the sandbox
is the in-process :class:`~agentbox.backends.fake.FakeBackend` (detached, as podman).

The gateway is frozen (SIGSTOP) the instant it is started, before it can serve: the
sandbox must start anyway, find the gateway's socket ready for its uid, and be
answered once the gateway runs. On the old order (the sandbox launched only once
the gateway said ready) the frozen gateway was never ready and the task failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

import fake_launcher
from agentbox.backends.fake import KILLED, FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.gateway import _process
from agentbox.launcher import Launcher, TaskRequest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace and socket (root)"
)

repo, _repo_template = fake_launcher.repo, fake_launcher._repo_template


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Each gateway the launcher starts is stopped with SIGSTOP right after its fork
    (its pid noted), or killed with ``how="kill"``; continued/reaped at the end."""
    seen: dict[str, Any] = {"how": "stop", "pids": []}
    real = _process.leave_unit_cgroup

    def freeze(pid: int) -> list[str]:
        seen["pids"].append(pid)
        os.kill(pid, signal.SIGSTOP if seen["how"] == "stop" else signal.SIGKILL)
        return real(pid)

    monkeypatch.setattr(_process, "leave_unit_cgroup", freeze)
    FakeBackend.reset()
    try:
        with FakeBackend.installed_as("podman"):
            yield seen
    finally:
        for pid in seen["pids"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert FakeBackend.live_names() == [], "a fake sandbox survived its task"
        FakeBackend.reset()


def _settings(settings: Settings) -> Settings:
    # The gateway drops to its own uid: it must reach its state dir under tmp_path.
    for d in (settings.data_dir.parent, settings.data_dir):
        d.chmod(0o755)
    return settings


def test_the_sandbox_starts_before_the_gateway_serves(
    settings: Settings, repo: Path, frozen: dict[str, Any]
) -> None:
    settings = _settings(settings)
    seen: dict[str, Any] = {}

    def agent(box: FakeSandbox, argv: Sequence[str]) -> None:
        del argv
        paths = TaskPaths(settings.data_dir, box.spec.name.removeprefix("agentbox-task-"))
        st = paths.gateway_socket.lstat()
        seen["socket"] = (stat.S_ISSOCK(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode))
        seen["sandbox_uid"] = paths.workspace.stat().st_uid  # its own uid slot's
        pid = frozen["pids"][0]
        seen["gateway_state"] = psutil.Process(pid).status()
        with socket.socket(socket.AF_UNIX) as c:
            c.settimeout(30)
            c.connect(str(paths.gateway_socket))  # queued: nobody serves yet
            c.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2\r\n\r\n{}")
            os.kill(pid, signal.SIGCONT)
            seen["answer"] = c.recv(100)

    with (
        FakeBackend.scripted(FakeScript(action=agent, files={"out.txt": b"x\n"})),
        Launcher(settings, max_tasks=1) as la,
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="do it")).id
        info = la.wait(tid, 120)
    assert info.status == "done", info.error
    # The sandbox ran while its gateway could not yet have served a thing...
    assert seen["gateway_state"] == psutil.STATUS_STOPPED
    # ...with the socket already there, the sandbox uid's, 0660...
    assert seen["socket"] == (True, seen["sandbox_uid"], 0o660)
    assert seen["sandbox_uid"] not in (0, settings.subid_base + settings.sandbox_uid)
    # ...and what it sent meanwhile was answered once the gateway ran (no token: 401).
    assert seen["answer"].startswith(b"HTTP/1.1 401"), seen["answer"]
    assert not psutil.pid_exists(frozen["pids"][0]) or (
        psutil.Process(frozen["pids"][0]).status() == psutil.STATUS_ZOMBIE
    )  # stopped with the task


def test_a_gateway_that_never_serves_fails_the_task_and_kills_its_sandbox(
    settings: Settings, repo: Path, frozen: dict[str, Any]
) -> None:
    settings = _settings(settings)
    frozen["how"] = "kill"
    with (
        FakeBackend.scripted(FakeScript(delay=120.0, files={"out.txt": b"x\n"})),
        Launcher(settings, max_tasks=1) as la,
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="do it")).id
        info = la.wait(tid, 120)
    assert info.status == "failed"
    assert info.error is not None and "gateway did not start" in info.error
    assert info.exit_code == KILLED  # killed, not left to run out its 120 s
    assert ("kill", f"agentbox-task-{tid}") in FakeBackend.events
