"""Host uid ranges per sandbox on real podman (issue 33 §9): ``agentbox exec`` and the pool.

``agentbox exec`` with a scratch workspace runs in a uid slot of its own, released
when it ends; a pooled sandbox is started in a slot of its own, and a task it serves
gets that slot (its workspace follows to the slot's uid) while its own slot is freed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.backends import _uidslots as slots
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _pool as pool
from agentbox.backends.podman import _pool_ends as pool_ends
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = [pytest.mark.podman]


def test_exec_runs_in_a_slot_of_its_own_and_frees_it(sandbox_settings: Settings) -> None:
    env = {**os.environ, "AGENTBOX_DATA_DIR": str(sandbox_settings.data_dir)}
    script = "cat /proc/self/uid_map; touch /workspace/made && echo wrote"
    res = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    first = res.stdout.split()
    base = int(first[1])
    assert base != sandbox_settings.subid_base  # not the old shared range
    assert (base - sandbox_settings.subid_base) % slots.SLOT_IDS == 0
    assert base >= slots.slot_base(sandbox_settings, 0)
    assert "wrote" in res.stdout  # the scratch workspace belongs to the slot's uid
    assert slots.held(sandbox_settings) == {}  # released at the end


def test_a_pooled_sandbox_hands_its_slot_to_the_task(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    settings = Settings(**{**sandbox_settings.model_dump(), "pool_size": 1})
    task_settings = settings.for_slot(slots.claim(settings, "agentbox-pooluid-task"))
    backend = PodmanBackend(task_settings)
    ws = make_workspace()
    os.chown(ws, task_settings.sandbox_host_uid, task_settings.sandbox_host_uid)
    template = SandboxSpec(name="template", image=default_image, workspace=ws, deadline=120)
    try:
        [started] = pool.fill(PodmanBackend(settings), template, 1, ttl=120)
        podman_boxes.track(started)
        pooled = slots.slot_of(settings, started)
        assert pooled is not None and pooled != task_settings.uid_slot
        spec = template.replace(name="agentbox-pooluid-task")
        podman_boxes.track(spec.name)
        log = tmp_path / "sandbox.log"
        backend.launch(spec, ["sh", "-c", "cat /proc/self/uid_map; touch made"], log=log)
        out: list[bytes] = []
        ended = backend.follow(spec.name, log=log, on_stdout=out.append, on_stderr=None)
        assert ended.exit_code == 0
        assert int(b"".join(out).split()[1]) == slots.slot_base(settings, pooled)
        assert (ws / "made").stat().st_uid == settings.for_slot(pooled).sandbox_host_uid
        # The task's name holds the pooled slot now; its own first slot is free.
        assert slots.held(settings) == {}  # and released once the sandbox is gone
    finally:
        pool_ends.drain(settings)
        for owner in ("agentbox-pooluid-task",):
            slots.release(settings, owner)
