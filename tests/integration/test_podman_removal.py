"""A detached podman sandbox is removed after its follower returns, off its user's path.

The follower records the end, settles the workspace disk and returns; ``podman rm``
runs in a remover process of its own session (``backends/podman/_removals.py``). The
remover is held back here by a gate file in front of its own code (real podman,
conmon, runc, workspace disk), so each test sees the moment between the return and
the removal:

* the follower has returned, the end is recorded and the disk settled, while the
  exited container still exists and its removal is pending;
* a process that ends (a foreground ``agentbox run``) does not wait for it: the
  remover outlives it and removes the container;
* a removal cut short (the remover killed with its launcher) leaves an exited
  container that the next launcher's orphan sweep (``remove_orphans``) lists and reaps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agentbox.backends import Exited
from agentbox.backends._k8slog import read_exit
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import _removals
from agentbox.config import Settings
from agentbox.core.wait import wait_until
from agentbox.launcher._adopt import remove_orphans
from agentbox.launcher._store import Store
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and cgroups need root"),
]


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name], check=False).returncode == 0


def _gated(gate: Path) -> str:
    """The remover's code, held until ``gate`` exists."""
    hold = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
    return hold + _removals._REMOVER


def _removers(name: str) -> list[psutil.Process]:
    """The remover processes of container ``name`` (its name is their argv[-2])."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if len(argv) > 5 and argv[1:4] == ["-I", "-S", "-c"] and argv[-2] == name:
            found.append(proc)
    return found


def test_follow_returns_before_the_container_is_removed(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ws = make_workspace()
    name = f"rm-later-{os.getpid()}"
    log = sandbox_settings.data_dir / "rm-later.log"
    gate = tmp_path / "gate"
    monkeypatch.setattr(_removals, "_REMOVER", _gated(gate))
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
        assert len(_removers(name)) == 1
    finally:
        gate.touch()
    assert _removals.wait(name, 120), "the removal did not end"
    assert not _exists(name)
    assert _removals.pending() == [] and _removers(name) == []


_CHILD = """
import sys
from pathlib import Path
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend, _removals

data, ws, name, image, gate = sys.argv[1:6]
hold = f"import os, time\\nwhile not os.path.exists({gate!r}): time.sleep(0.02)\\n"
_removals._REMOVER = hold + _removals._REMOVER
from agentbox.config import Settings
be = PodmanBackend(Settings(data_dir=Path(data)))
log = Path(data) / (name + ".log")
be.launch(SandboxSpec(name=name, image=image, workspace=Path(ws), deadline=120),
          ["echo", "x"], log=log)
ended = be.follow(name, log=log, on_stdout=None, on_stderr=None)
print("followed", ended.exit_code, _removals.pending(), flush=True)
"""


def _child(
    settings: Settings, ws: Path, name: str, image: str, gate: Path
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", _CHILD, str(settings.data_dir), str(ws), name, image, str(gate)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_a_process_that_ends_leaves_its_removal_to_the_remover(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    tmp_path: Path,
) -> None:
    name = f"rm-exit-{os.getpid()}"
    podman_boxes.track(name)
    gate = tmp_path / "gate"
    child = _child(sandbox_settings, make_workspace(), name, default_image, gate)
    try:
        out, _ = child.communicate(timeout=180)
        assert child.returncode == 0
        assert out.strip() == f"followed 0 ['{name}']", "the removal was not pending at the return"
        assert _exists(name), "nothing to remove: the proof did not hold the removal back"
        assert len(_removers(name)) == 1, "the remover did not outlive its process"
        # It and its podman rm run at a lower priority than the task's end (nice 0).
        assert _removers(name)[0].nice() == _removals.REMOVER_NICE
    finally:
        gate.touch()
    end = time.monotonic() + 60  # a bound for a hang, not a speed target
    while (_exists(name) or _removers(name)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not _exists(name), "the remover did not remove it once its process had ended"


def test_a_removal_cut_short_is_reaped_by_the_orphan_sweep(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    tmp_path: Path,
) -> None:
    name = f"rm-killed-{os.getpid()}"
    podman_boxes.track(name)
    child = _child(sandbox_settings, make_workspace(), name, default_image, tmp_path / "gate")
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # waits for the follow's return
        assert line.startswith("followed 0"), line
        # The remover is started by a thread as the follow returns (_removals): once it
        # runs (held at its gate), the launcher dies, and then the remover with it.
        wait_until(
            lambda: _removers(name) or None,
            timeout=60,
            on_timeout=lambda: AssertionError("no remover was started"),
        )
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        removers = _removers(name)
        assert len(removers) == 1
        removers[0].kill()
        removers[0].wait(30)
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
        for proc in _removers(name):
            proc.kill()
