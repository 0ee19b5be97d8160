"""A detached podman sandbox is removed after its follower returns, off its user's path.

The follower records the end, settles the workspace disk and returns; ``podman rm``
runs on a tracked thread (``backends/podman/_removals.py``). The removal is held
back here by a gate in front of the real ``force_remove`` (real podman, conmon, runc,
workspace disk), so each test sees the moment between the return and the removal:

* the follower has returned, the end is recorded and the disk settled, while the
  exited container still exists and its removal is pending;
* a process that ends normally (a foreground ``agentbox run``) waits for it;
* a process killed with its removal pending leaves an exited container that the next
  launcher's orphan sweep (``remove_orphans``) lists and reaps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends._k8slog import read_exit
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import _removals
from agentbox.config import Settings
from agentbox.launcher._adopt import remove_orphans
from agentbox.launcher._store import Store
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and cgroups need root"),
]


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name], check=False).returncode == 0


def test_follow_returns_before_the_container_is_removed(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = make_workspace()
    name = f"rm-later-{os.getpid()}"
    log = sandbox_settings.data_dir / "rm-later.log"
    gate = threading.Event()
    real = _removals.force_remove

    def gated(n: str, *a: object, **kw: object) -> None:
        gate.wait(120)
        real(n)

    monkeypatch.setattr(_removals, "force_remove", gated)
    spec = SandboxSpec(name=name, image=default_image, workspace=ws, deadline=120)
    try:
        podman_boxes.launch(
            spec, ["sh", "-c", "echo up; echo made > /workspace/f; exit 4"], log=log
        )
        out: list[bytes] = []
        ended = podman_boxes.backend.follow(name, log=log, on_stdout=out.append, on_stderr=None)
        assert ended == Exited(4, False) and b"".join(out) == b"up\n"
        assert read_exit(log) == Exited(4, False), "the end is recorded before the return"
        assert (ws / "f").read_text() == "made\n", "the disk is copied back before the return"
        assert not os.path.ismount(ws), "the disk is settled before the return"
        assert _exists(name), "follow waited for the removal"
        assert _removals.pending() == [name]
    finally:
        gate.set()
    assert _removals.wait(name, 120), "the removal did not end"
    assert not _exists(name)
    assert _removals.pending() == []


_CHILD = """
import sys, time
from pathlib import Path
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend, _removals
from agentbox.config import Settings

data, ws, name, image, hold = sys.argv[1:6]
real = _removals.force_remove

def slow(n, *a, **kw):  # the removal is still under way when the main thread ends
    time.sleep(float(hold))
    real(n)

_removals.force_remove = slow
be = PodmanBackend(Settings(data_dir=Path(data)))
log = Path(data) / (name + ".log")
be.launch(SandboxSpec(name=name, image=image, workspace=Path(ws), deadline=120),
          ["echo", "x"], log=log)
ended = be.follow(name, log=log, on_stdout=None, on_stderr=None)
print("followed", ended.exit_code, _removals.pending(), flush=True)
"""


def _child(
    settings: Settings, ws: Path, name: str, image: str, hold: float
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", _CHILD, str(settings.data_dir), str(ws), name, image, str(hold)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_a_process_that_ends_waits_for_its_removal(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
) -> None:
    name = f"rm-exit-{os.getpid()}"
    podman_boxes.track(name)
    child = _child(sandbox_settings, make_workspace(), name, default_image, 2.0)
    out, _ = child.communicate(timeout=180)
    assert child.returncode == 0
    assert out.strip() == f"followed 0 ['{name}']", "the removal was not pending at the return"
    assert not _exists(name), "the process exited before its sandbox was removed"


def test_a_removal_cut_short_is_reaped_by_the_orphan_sweep(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    tmp_path: Path,
) -> None:
    name = f"rm-killed-{os.getpid()}"
    podman_boxes.track(name)
    child = _child(sandbox_settings, make_workspace(), name, default_image, 3600.0)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # waits for the follow's return
        assert line.startswith("followed 0"), line
        child.send_signal(signal.SIGKILL)  # the launcher dies with the removal pending
        child.wait(30)
        assert _exists(name), "nothing left to reap: the proof did not hold the removal back"
        listed = [n for n in podman_boxes.backend.owned() if n == name]
        assert listed == [name], "the ended sandbox is not listed as the data dir's"
        remove_orphans(sandbox_settings, Store(tmp_path / "state.db"))
        end = time.monotonic() + 60  # a bound for a hang, not a speed target
        while _exists(name) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _exists(name), "the orphan sweep left the ended sandbox"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
