"""A cancel's kill that races its sandbox's start must not remove the sandbox under it.

The race (a CI flake of ``test_cancel_and_queue_limit_over_http``): the launcher
records a task ``running`` with its sandbox's name *before* ``podman run -d``, so a
cancel in that window calls the backend's ``kill(name)`` while the sandbox is being
created. ``kill`` sent ``podman kill`` (no container yet: nothing), looked the name
up (none yet), took it for an attached container and ran ``podman rm -f`` — which by
then found the container ``podman run -d`` had just created, and removed it under the
launch: the launch failed, or returned with no container left to follow, and the
task ended ``failed`` (``SandboxGone``) instead of ``cancelled``, with nothing of
what the agent wrote collected.

The window is held open here, deterministically, by pausing the kill right after its
look-up found nothing until the container exists. A kill must then leave the
sandbox to its launch; the follower's next kill (the launcher's monitor repeats it)
ends it, and the follower collects what the agent wrote.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends import Exited
from agentbox.backends.base import WORKSPACE_IN_SANDBOX, SandboxSpec
from agentbox.backends.podman import PodmanBackend, _removals
from agentbox.backends.podman import _backend as podman_backend
from agentbox.backends.podman import _detach as detach
from agentbox.config import Settings
from agentbox.core.wait import wait_until
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and cgroups need root"),
]


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name]).returncode == 0


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _never_made() -> BaseException:
    return AssertionError("the sandbox never started")


def test_a_kill_racing_the_launch_leaves_the_sandbox_to_be_killed_and_collected(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = make_workspace()
    name = f"cancel-race-{os.getpid()}"
    log = sandbox_settings.data_dir / "sandbox.log"
    backend = podman_boxes.backend
    assert isinstance(backend, PodmanBackend)
    spec = SandboxSpec(name=name, image=default_image, workspace=ws, deadline=600)
    script = f"echo partial > {WORKSPACE_IN_SANDBOX}/partial.txt; echo up; sleep 300"
    real_inspect = detach.inspect
    killer = threading.current_thread()
    held = threading.Event()

    def paused_inspect(what: str) -> dict[str, Any] | None:
        """The kill's look-up, held (on the killing thread only) once it found nothing
        until ``podman run -d`` has made the container: the race, every time."""
        info = real_inspect(what)
        if info is None and threading.current_thread() is killer:
            held.set()
            wait_until(lambda: _exists(what), timeout=120, on_timeout=_never_made)
        return info

    monkeypatch.setattr(podman_backend, "inspect", paused_inspect)
    launched: dict[str, object] = {}

    def launch() -> None:
        try:
            podman_boxes.launch(spec, ["sh", "-c", script], log=log)
            launched["ok"] = True
        except Exception as exc:  # said by the assertion below
            launched["error"] = exc

    try:
        killer = threading.Thread(target=backend.kill, args=(name,), daemon=True)
        killer.start()
        assert held.wait(60), "the kill never looked the sandbox up"
        starter = threading.Thread(target=launch, daemon=True)
        starter.start()
        starter.join(180)
        killer.join(120)
        assert not starter.is_alive() and not killer.is_alive(), "launch or kill hung"
        assert launched.get("ok"), f"the racing kill broke the launch: {launched.get('error')}"
        assert _exists(name), "the racing kill removed the sandbox its launch had just made"
        # The launcher's monitor kills again after the launch: now it lands.
        wait_until(lambda: b"up" in _read(log), timeout=60, on_timeout=_never_made)
        backend.kill(name)
        out: list[bytes] = []
        ended = backend.follow(name, log=log, on_stdout=out.append, on_stderr=None)
        assert ended == Exited(137, False)
        assert b"".join(out) == b"up\n"
        assert _removals.wait(name, 120), "the container's removal (off the path) hung"
        assert not _exists(name)
        assert not os.path.ismount(ws), "the workspace disk was not settled"
        assert (ws / "partial.txt").read_text() == "partial\n", "what the agent wrote was lost"
    finally:
        subprocess.run(["podman", "rm", "-f", "--time", "0", name], capture_output=True)
        detach.settle_orphan_disks(sandbox_settings, name)
        assert_no_mounts_under(sandbox_settings.data_dir)
