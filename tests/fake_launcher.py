"""The harness of the live-restore tests on the FakeBackend (``test_live_restore_*``).

The real launcher code runs (store, workers, workspace copy, shadow-git collection,
publishing into a real git repo); the sandbox is the in-process FakeBackend and the
gateway a stand-in process whose command line is a gateway's, so the launcher's pid +
start time + command line + handshake check runs for real. A test module imports the
fixtures it uses (``fake``, ``repo``, ``_repo_template``) and its own freezer.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.fake import FakeBackend
from agentbox.config import Settings
from agentbox.core.wait import wait_until
from agentbox.gateway import GatewayHandle
from agentbox.gateway._handshake import HANDSHAKE_VERSION, write_handshake
from agentbox.gateway._usage import Usage, write_usage
from agentbox.launcher import Launcher, TaskRequest, _runner
from agentbox.launcher._store import Store
from git_helpers import git

#: The handshake version the next stand-in gateway writes (None: it writes none).
#: Reset to the current one by ``fake``.
HANDSHAKE: dict[str, int | None] = {"v": HANDSHAKE_VERSION}


class StandInGateway(GatewayHandle):
    """A real process in its own group whose command line names a gateway on the task's
    socket, a real socket, the usage file and the handshake (written for its pid)."""

    def __init__(self, *, socket_path: Path, usage_file: Path, model: str, budget: int) -> None:
        # -I -S: no site-packages, a third of a plain interpreter's start-up.
        argv = [sys.executable, "-ISc", "import time; time.sleep(600)", "agentbox.gateway",
                "--listen", f"unix:{socket_path}"]  # fmt: skip
        proc = subprocess.Popen(argv, start_new_session=True)
        super().__init__(proc, socket_path=socket_path, usage_file=usage_file, log_file=None)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(socket_path))
        write_usage(usage_file, Usage(model=model, budget=budget))
        version = HANDSHAKE["v"]
        if version is not None:
            write_handshake(usage_file.parent)
            hs = usage_file.parent / "gateway.json"
            text = hs.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {proc.pid}')
            hs.write_text(text.replace(f'"v": {HANDSHAKE_VERSION}', f'"v": {version}'))

    def stop(self, grace: float = 5.0) -> int | None:
        self.listener.close()
        return super().stop(grace=min(grace, 1.0))


#: Every stand-in gateway the current test spawned, in order.
GATEWAYS: list[StandInGateway] = []


def spawn_gateway(**kw: Any) -> GatewayHandle:
    gw = StandInGateway(socket_path=kw["socket_path"], usage_file=kw["usage_file"],
                        model=kw["model"], budget=kw["budget"])  # fmt: skip
    GATEWAYS.append(gw)
    return gw


class Frozen(BaseException):
    """Raised in a frozen ("dead") launcher's worker when the test ends: it acts no more."""


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeBackend]]:
    FakeBackend.reset()
    GATEWAYS.clear()
    HANDSHAKE["v"] = HANDSHAKE_VERSION
    monkeypatch.setattr(_runner, "spawn_gateway", spawn_gateway)
    with FakeBackend.installed_as("podman"):
        yield FakeBackend
    for gw in GATEWAYS:
        gw.stop()
    assert FakeBackend.live_names() == [], "a fake sandbox survived its task"
    FakeBackend.reset()


@pytest.fixture(scope="module")
def _repo_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real repo made with git once per module; each test gets a copy of it."""
    path = tmp_path_factory.mktemp("template") / "proj"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "-c", "maintenance.auto=false", "commit", "-q", "-m", "init")
    return path


@pytest.fixture
def repo(settings: Settings, _repo_template: Path) -> Path:
    path = settings.repos_root / "proj"
    shutil.copytree(_repo_template, path, symlinks=True)
    return path


def dead_owner(store: Store, *task_ids: str) -> None:
    """The crash: the owner recorded for these tasks is now a process that is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    for tid in task_ids:
        store.update(tid, owner_pid=dead.pid, owner_start=1.0)


def submit(la: Launcher, repo: Path, task_id: str, **kw: Any) -> str:
    return la.submit(TaskRequest(repo=str(repo), task="do it", task_id=task_id, **kw)).id


def transcript(settings: Settings, tid: str) -> str:
    return (settings.data_dir / "tasks" / tid / "logs" / "launcher.log").read_text()


def launches(name: str) -> int:
    """How often the fake launched sandbox ``name``."""
    return sum(1 for verb, n in FakeBackend.events if verb == "launch" and n == name)


def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    wait_until(cond, timeout=timeout, on_timeout=lambda: AssertionError("condition not reached"))
