"""A detached podman sandbox's end is known from conmon's exit file, not from conmon's exit.

conmon writes ``<exit-dir>/<id>`` the moment the container exits, then runs podman's
``container cleanup`` and waits for it before it exits itself (0.3 to 0.8 s on a busy
host). The follower used to wait for conmon to go (a 0.2 s poll) and then ask
``podman inspect``; now it records the end from the exit file at once, and its
caller's stop steps (the gateway's) may start while the sandbox is still removed.

The proof holds conmon back (SIGSTOP) right after it wrote the exit file: the end
must be recorded (``<log>.exit``) while conmon is still there. Before the change the
follower waited for conmon for ever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends._k8slog import read_exit
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend, _removals
from agentbox.backends.podman import _detach as detach
from agentbox.backends.podman._exitfile import exit_file_of
from agentbox.config import Settings
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and cgroups need root"),
]


def test_the_end_is_recorded_from_the_exit_file_while_conmon_still_runs(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    sandbox_factory: Callable[[PodmanBackend, Settings], SandboxTracker],
) -> None:
    ws = make_workspace()
    name = f"det-end-{os.getpid()}"
    log = sandbox_settings.data_dir / "sandbox.log"
    backend = PodmanBackend(sandbox_settings)
    tracker = sandbox_factory(backend, sandbox_settings)  # nothing of it may survive the test
    spec = SandboxSpec(name=name, image=default_image, workspace=ws, deadline=600)
    stopped = None
    try:
        tracker.launch(spec, ["sh", "-c", "echo up; sleep 2; exit 3"], log=log)
        info = detach.inspect(name)
        assert info is not None
        conmon = detach.conmon_of(info)
        exit_file = exit_file_of(conmon, info)
        assert conmon is not None and exit_file is not None, "no conmon exit file to watch"
        box: dict[str, object] = {}

        def follow() -> None:
            out: list[bytes] = []
            box["ended"] = backend.follow(name, log=log, on_stdout=out.append, on_stderr=None)
            box["out"] = b"".join(out)

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        end = time.monotonic() + 60
        while not exit_file.exists() and time.monotonic() < end:
            time.sleep(0.002)
        assert exit_file.exists(), "the sandbox never exited"
        if not conmon.is_running():
            pytest.skip("conmon exited before it could be held back (its cleanup was quick)")
        os.kill(conmon.pid, signal.SIGSTOP)  # conmon stays, its cleanup done or not
        stopped = conmon.pid
        end = time.monotonic() + 60  # a bound for a hang, not a speed target
        while read_exit(log) is None and time.monotonic() < end:
            time.sleep(0.01)
        assert read_exit(log) == Exited(3, False), "the end waited for conmon to exit"
        assert conmon.is_running(), "conmon went meanwhile: the proof did not hold it back"
        os.kill(conmon.pid, signal.SIGCONT)
        stopped = None
        follower.join(120)
        assert not follower.is_alive(), "follow hung"
        assert box["ended"] == Exited(3, False)
        assert box["out"] == b"up\n"
        assert _removals.wait(name, 120), "the container's removal did not end"
        assert subprocess.run(["podman", "container", "exists", name]).returncode == 1
        assert not os.path.ismount(ws), "the workspace disk was not settled"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        subprocess.run(["podman", "rm", "-f", "--time", "0", name], capture_output=True)
        detach.settle_orphan_disks(sandbox_settings, name)
        assert_no_mounts_under(sandbox_settings.data_dir)


def test_a_disk_whose_owner_outlived_the_follower_is_settled_once_owner_and_container_go(
    sandbox_settings: Settings, default_image: str, make_workspace: Callable[[], Path]
) -> None:
    """The follower's settle met the disk's recorded owner still alive (conmon finishing a
    slow cleanup) and its container still there: the disk used to stay mounted until the
    next launcher's start. Now it is settled as soon as both are gone, and what the agent
    wrote on it is copied back. A real loop-mounted disk, a real container, a real owner
    process standing in for conmon."""
    import psutil

    from agentbox.backends._wsdisk import WorkspaceDisk
    from agentbox.boxfile import DiskLimit

    ws = make_workspace()
    name = f"late-settle-{os.getpid()}"
    (ws / "keep.txt").write_text("from the repo\n")
    disk = WorkspaceDisk(sandbox_settings, name, ws, DiskLimit(size=64 << 20, inodes=4096))
    owner = subprocess.Popen(["sleep", "600"])
    try:
        disk.mount()
        (ws / "late.txt").write_text("written on the disk\n")
        disk.hand_over(owner.pid, f"{psutil.Process(owner.pid).create_time():.0f}")
        subprocess.run(["podman", "create", "--name", name, default_image, "true"],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        PodmanBackend(sandbox_settings)._settle(name, None)  # the follower's, owner alive
        assert os.path.ismount(ws), "settled while its owner lived"
        owner.kill()
        owner.wait(30)
        subprocess.run(["podman", "rm", name], check=True, capture_output=True, timeout=120)
        end = time.monotonic() + 90  # a bound for a hang, not a speed target
        while os.path.ismount(ws) and time.monotonic() < end:
            time.sleep(0.1)
        assert not os.path.ismount(ws), "the disk was left to the next launcher's start"
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert (ws / "keep.txt").read_text() == "from the repo\n"
    finally:
        owner.kill()
        owner.wait(30)
        subprocess.run(["podman", "rm", "-f", "--time", "0", name], capture_output=True)
        detach.settle_orphan_disks(sandbox_settings, name)
        end = time.monotonic() + 30
        while detach._late and time.monotonic() < end:
            time.sleep(0.1)
        assert_no_mounts_under(sandbox_settings.data_dir)
