"""Positive controls for the "nothing survived" check of the backend contract tests.

Each kind of survivor the tracker looks for (a process, a cgroup-less recorded
pid, a VM dir, a unix socket, an environment memfd) is planted for real by a
leaky in-process sandbox, and the tracker must name it; a clean sandbox leaves
nothing to name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import LABEL, SandboxSpec
from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.core.wait import wait_until
from sandbox_leaks import ENV_MEMFD, SandboxTracker


@pytest.fixture
def tracker(settings: Settings) -> Iterator[SandboxTracker]:
    FakeBackend.reset()
    t = SandboxTracker(FakeBackend(settings), settings)
    yield t
    t.close()
    FakeBackend.reset()


def _spec(tmp_path: Path, name: str) -> SandboxSpec:
    ws = tmp_path / f"ws-{name}"
    ws.mkdir()
    return SandboxSpec(name=name, image="x", workspace=ws)


def test_a_clean_sandbox_leaves_nothing(tracker: SandboxTracker, tmp_path: Path) -> None:
    with tracker.create(_spec(tmp_path, "agentbox-leak-clean")) as box:
        assert box.exec(["true"]).exit_code == 0
    tracker.assert_clean(settle=0)


def test_a_surviving_process_is_found(
    tracker: SandboxTracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "agentbox-leak-proc"
    proc = subprocess.Popen(["sleep", "600"])
    try:
        monkeypatch.setattr(FakeSandbox, "host_pids", lambda self: [proc.pid])
        tracker.create(_spec(tmp_path, name)).destroy()  # "forgets" to kill its process
        left = tracker.leftovers()
        assert any(f"process {proc.pid} still runs" in x for x in left), left
    finally:
        proc.kill()
        proc.wait()
    assert tracker.leftovers() == []


def test_a_process_naming_the_sandbox_is_found(tracker: SandboxTracker, tmp_path: Path) -> None:
    name = "agentbox-leak-named"
    tracker.create(_spec(tmp_path, name)).destroy()
    # As conmon names its container: ``-n NAME`` among its arguments.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "-n", name])
    try:
        # Its command line names the sandbox once it has exec'd (a loaded host may not
        # have got there by the time Popen returns: this raced in a CI run).
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        wait_until(
            lambda: name.encode() in cmdline.read_bytes(),
            timeout=60,
            on_timeout=lambda: AssertionError(f"never exec'd: {cmdline.read_bytes()!r}"),
        )
        left = tracker.leftovers()
        assert any(f"process {proc.pid} names it" in x for x in left), left
    finally:
        proc.kill()
        proc.wait()


def test_a_vm_dir_and_a_socket_are_found(
    tracker: SandboxTracker, settings: Settings, tmp_path: Path
) -> None:
    name = "agentbox-leak-vm"
    tracker.create(_spec(tmp_path, name)).destroy()
    vm = settings.data_dir / "microvm" / f"{name}-vm"
    vm.mkdir(parents=True)
    (vm / "owner").write_text(json.dumps({LABEL: name, "pid": 1}))
    sock = socket.socket(socket.AF_UNIX)
    path = Path(f"/tmp/{name}-{os.getpid()}.sock")  # short enough for AF_UNIX
    sock.bind(str(path))
    try:
        left = tracker.leftovers()
        assert any("VM dir" in x for x in left), left
        assert any("socket" in x and name in x for x in left), left
    finally:
        sock.close()
        path.unlink()


def test_an_open_env_memfd_is_found(tracker: SandboxTracker, tmp_path: Path) -> None:
    tracker.create(_spec(tmp_path, "agentbox-leak-env")).destroy()
    fd = os.memfd_create(ENV_MEMFD.removeprefix("/memfd:"))
    try:
        left = tracker.leftovers()
        assert any("environment memfd" in x for x in left), left
    finally:
        os.close(fd)
    assert tracker.leftovers() == []


def test_artifacts_of_a_live_sandbox(tracker: SandboxTracker, tmp_path: Path) -> None:
    box = tracker.create(_spec(tmp_path, "agentbox-leak-art"))
    (tracker.settings.data_dir / "x.log").write_text("a log line\n")
    saved = tracker.save_artifacts(tmp_path / "art")
    info = json.loads((tmp_path / "art" / "agentbox-leak-art.json").read_text())
    assert info["posture"]["backend"] == "fake"
    assert any(p.name == "x.log" for p in saved)
    box.destroy()


def test_the_fake_is_scriptable_for_failures(tracker: SandboxTracker, tmp_path: Path) -> None:
    with FakeBackend.scripted(FakeScript(fail=frozenset({"exec"}))):
        box = tracker.create(_spec(tmp_path, "agentbox-leak-fail"))
        with pytest.raises(Exception, match="scripted failure of exec"):
            box.exec(["true"])
        box.destroy()
    tracker.assert_clean(settle=0)
