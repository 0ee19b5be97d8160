"""The resource sampler of a task that claimed a pooled sandbox finds the sandbox's
cgroup in /proc, without ``podman inspect``: the pooled container's conmon keeps the
slot name it was started under, and the claim renamed the container to the task's
sandbox name, so it is found through the container id the claim record names (a
podman process during the agent's start otherwise). Real podman, a real pool."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_podman_pool import _fill, _template, pooled  # noqa: F401 (a fixture)

from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _removals as removals
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.wait import wait_until
from agentbox.observe import resources
from agentbox.observe.resources import Cgroup, Sampler
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and mounts need root"),
]


def test_a_claimed_pool_sandboxs_cgroup_is_found_without_podman(
    pooled: tuple[PodmanBackend, Settings],  # noqa: F811
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, settings = pooled
    ws = make_workspace()
    slots = _fill(podman_boxes, backend, _template(default_image, ws), 1)
    assert len(slots) == 1
    spec = _template(default_image, ws).replace(name=f"agentbox-poolres-{tmp_path.name[-8:]}")
    log = tmp_path / "sandbox.log"
    podman_boxes.track(spec.name)
    backend.launch(spec, ["sleep", "60"], log=log)
    try:
        assert (settings.data_dir / "pool" / "claims" / f"{spec.name}.json").exists()
        wait_until(
            lambda: subprocess.run(
                ["podman", "inspect", "--format", "{{.State.Pid}}", spec.name],
                capture_output=True, text=True,
            ).returncode == 0,
            timeout=120, on_timeout=lambda: AssertionError("never renamed"),
        )  # fmt: skip
        pid = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Pid}}", spec.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        engine = Cgroup.of_pid(int(pid))
        assert engine is not None
        # The conmon's name is the slot's, not the task's: by name alone it is not found.
        assert resources.conmon_child(spec.name) is None

        def no_podman(*_: object, **__: object) -> None:
            raise AssertionError("podman was run")

        monkeypatch.setattr(_proc, "run", no_podman)
        task_root = settings.data_dir / "tasks" / "t-poolres"
        task_root.mkdir(parents=True)
        sampler = Sampler(task_root, "podman", spec.name, ws)
        assert sampler._find() == engine
    finally:
        monkeypatch.undo()
        backend.kill(spec.name)
        backend.follow(spec.name, log=log, on_stdout=None, on_stderr=None, poll=0.05)
        assert removals.wait(spec.name, 120), "the container's removal (off the path) hung"
