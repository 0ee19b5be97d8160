"""A foreground ``agentbox run`` starts its task first and sweeps orphans beside it.

The sweep (``reconcile(adopt=False)``) lists podman, docker and qemu sandboxes and
the gateways: 0.1-0.3 s of subprocesses that used to come before the task's own
start. It now runs on a thread beside the task, is done before the command ends,
and a sweep that fails is logged while the task goes on. The real launcher runs the
task on the in-process FakeBackend; only the sandbox and the gateway are stand-ins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import test_lifecycle_fake
import typer

from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.cli import _run
from agentbox.config import Settings
from agentbox.errors import AgentboxError, SandboxError
from agentbox.launcher import Launcher, TaskRequest
from git_helpers import commit_repo

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)

fake = test_lifecycle_fake.fake


@pytest.fixture
def repo(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed repo; the CLI's settings (read from the environment) are ``settings``."""
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("AGENTBOX_REPOS_ROOT", str(settings.repos_root))
    return commit_repo(settings.repos_root / "proj")


def _run_in_foreground(repo: Path) -> int:
    req = TaskRequest(repo=str(repo), task="add a.txt")
    with (
        FakeBackend.scripted(FakeScript(files={"a.txt": b"a\n"})),
        pytest.raises(typer.Exit) as ended,
    ):
        _run._foreground(req, None, as_json=True)
    code: int = ended.value.exit_code
    return code


def test_the_task_is_submitted_before_the_orphan_sweep_runs(
    fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    submitted = threading.Event()
    swept: list[tuple[bool, bool]] = []
    real_submit, real_reconcile = Launcher.submit, Launcher.reconcile

    def submit(self: Launcher, *args: Any, **kw: Any) -> Any:
        info = real_submit(self, *args, **kw)
        submitted.set()
        return info

    def reconcile(self: Launcher, *, adopt: bool = True) -> list[str]:
        # Before the change the sweep ran first, in the command's own thread: it waited
        # here for a submit that could only come after it, and failed.
        first = submitted.wait(20)
        swept.append((adopt, first))
        assert first, "the orphan sweep ran before the task was submitted"
        return real_reconcile(self, adopt=adopt)

    monkeypatch.setattr(Launcher, "submit", submit)
    monkeypatch.setattr(Launcher, "reconcile", reconcile)
    code = _run_in_foreground(repo)
    out = json.loads(capsys.readouterr().out)
    assert swept == [(False, True)]  # once, others' tasks left to the service, after submit
    assert code == 0, out
    assert out["task"]["status"] == "done"
    assert out["result"]["changed"] is True and "a.txt" in out["result"]["diff"]
    assert not [t for t in threading.enumerate() if t.name == "agentbox-orphan-sweep"]


def test_a_failed_sweep_is_logged_and_the_task_goes_on(
    fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    def reconcile(self: Launcher, *, adopt: bool = True) -> list[str]:
        raise SandboxError("podman ps failed: cannot connect", sandbox="-")

    monkeypatch.setattr(Launcher, "reconcile", reconcile)
    code = _run_in_foreground(repo)
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["task"]["status"] == "done"
    assert "orphan sweep failed" in captured.err
    assert "podman ps failed" in captured.err


def test_the_sweep_runs_at_a_low_priority_and_the_command_does_not(
    fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The sweep's thread, and what it starts, yield the cores to the task's own start."""
    seen: dict[str, int] = {}
    real_reconcile = Launcher.reconcile

    def reconcile(self: Launcher, *, adopt: bool = True) -> list[str]:
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        # A process the sweep starts (podman ps, …) inherits its thread's nice value.
        out = subprocess.run(["cat", "/proc/self/stat"], capture_output=True, text=True)
        seen["child"] = int(out.stdout.rpartition(")")[2].split()[16])
        return real_reconcile(self, adopt=adopt)

    monkeypatch.setattr(Launcher, "reconcile", reconcile)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert mine < _run.SWEEP_NICE  # else the test could not tell
    code = _run_in_foreground(repo)
    assert code == 0, capsys.readouterr()
    assert seen == {"thread": _run.SWEEP_NICE, "child": _run.SWEEP_NICE}
    # The command's own thread (and so the task's launcher) keeps its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_sweep_waits_for_the_tasks_sandbox_to_run(
    fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Not beside the workspace copy and the sandbox's start (this process's own work on
    the user's wait): only once the task left the queue."""
    statuses: list[str] = []
    real_reconcile = Launcher.reconcile

    def reconcile(self: Launcher, *, adopt: bool = True) -> list[str]:
        statuses.extend(row.status for row in self.store.all())
        return real_reconcile(self, adopt=adopt)

    monkeypatch.setattr(Launcher, "reconcile", reconcile)
    code = _run_in_foreground(repo)
    assert code == 0, capsys.readouterr()
    assert len(statuses) == 1 and statuses[0] != "queued", statuses


def test_a_refused_request_is_still_swept_and_says_why(
    fake: type[FakeBackend], repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swept: list[bool] = []
    real_reconcile = Launcher.reconcile

    def reconcile(self: Launcher, *, adopt: bool = True) -> list[str]:
        swept.append(adopt)
        return real_reconcile(self, adopt=adopt)

    monkeypatch.setattr(Launcher, "reconcile", reconcile)
    req = TaskRequest(repo=str(repo.parent / "no-such-repo"), task="add a.txt")
    with pytest.raises(AgentboxError, match="no-such-repo"):
        _run._foreground(req, None, as_json=True)
    assert swept == [False]  # at once: there is no task to wait for


def test_with_a_launcher_service_running_the_run_leaves_the_sweep_to_it(
    fake: type[FakeBackend],
    repo: Path,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    """A service sweeps every minute itself (launcher._server.Sweeper): the run's own
    sweep would be a second one, its podman listings on the task's start."""
    from agentbox.launcher._server import LOCK_NAME, RUN_DIR

    assert (RUN_DIR, LOCK_NAME) == _run.SERVICE_LOCK
    swept: list[bool] = []
    monkeypatch.setattr(Launcher, "reconcile", lambda self, *, adopt=True: swept.append(adopt))
    run_dir = settings.data_dir / RUN_DIR
    run_dir.mkdir(parents=True, exist_ok=True)
    # The service's lock, as a service holds it, in a process of its own.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from agentbox.launcher._server import "
         "InstanceLock; InstanceLock(Path(sys.argv[1])); print('held', flush=True); "
         "sys.stdin.read()", str(run_dir / LOCK_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code = _run_in_foreground(repo)
    finally:
        holder.communicate("")
    assert code == 0, capsys.readouterr()
    assert swept == []
    # No service: the run sweeps, as before.
    assert _run_in_foreground(repo) == 0
    assert swept == [False]


def test_a_launcher_service_sweeps_every_so_often_and_a_failed_sweep_is_logged(
    capsys: Any,
) -> None:
    from agentbox.core.wait import wait_until
    from agentbox.launcher._server import SWEEP_NICE, Sweeper

    calls: list[int] = []

    class _Launcher:
        draining = False

        def reconcile(self) -> list[str]:
            calls.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            if len(calls) == 1:
                raise SandboxError("podman ps failed: cannot connect", sandbox="-")
            return []

    sweeper = Sweeper(_Launcher(), every=0.05).start()  # type: ignore[arg-type]
    try:
        wait_until(lambda: len(calls) >= 3, timeout=60,
                   on_timeout=lambda: AssertionError("the service swept no more"))  # fmt: skip
    finally:
        sweeper.stop()
    assert set(calls) == {SWEEP_NICE}
    assert "orphan sweep failed" in capsys.readouterr().err
