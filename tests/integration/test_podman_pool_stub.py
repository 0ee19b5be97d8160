"""A pooled sandbox whose stub looks late still runs its task (the claim race).

A claim writes the go-file into the slot's ``/workspace`` and binds the task's
workspace over that directory right after. A stub that looked for the go-file by
path only after the bind (descheduled on a busy host: seen as ``Exited(137,
timed_out)`` with no output in ``test_podman_pool.py``'s keeper test and
``bench/start_latency.py`` at load ~13) found the task's workspace instead and
idled to the deadline. Made deterministic here: the stub is frozen (SIGSTOP) over
the whole claim and thawed after the bind. Real podman, runc, mounts.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends import Exited
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _pool as pool
from agentbox.backends.podman import _pool_ends as pool_ends
from agentbox.backends.podman._detach import conmon_of, inspect
from agentbox.config import Settings
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and mounts need root"),
]


@pytest.fixture
def pooled(sandbox_settings: Settings) -> Iterator[tuple[PodmanBackend, Settings]]:
    settings = sandbox_settings.model_copy(update={"pool_size": 1})
    yield PodmanBackend(settings), settings
    pool_ends.drain(settings)
    assert_no_mounts_under(settings.data_dir)


def test_a_stub_frozen_over_the_claim_still_runs_the_task(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    tmp_path: Path,
) -> None:
    backend, _ = pooled
    template = SandboxSpec(name="t", image=default_image, workspace=make_workspace(), deadline=30)
    (slot,) = pool.fill(backend, template, 1, ttl=120)
    podman_boxes.track(slot)
    conmon = conmon_of(inspect(slot) or {})
    assert conmon is not None
    stubs = [p for p in conmon.children(recursive=True) if "python" in p.name()]
    assert len(stubs) == 1, stubs
    ws = make_workspace()
    (ws / "in.txt").write_text("task\n")
    spec = template.replace(name=f"pool-stub-{os.getpid()}", workspace=ws)
    podman_boxes.track(spec.name)
    log = tmp_path / "task.log"
    os.kill(stubs[0].pid, signal.SIGSTOP)
    try:
        backend.launch(spec, ["sh", "-c", "cat in.txt; echo out > out.txt"], log=log)
        assert spec.name in backend.claimed, "not served by the pool"
    finally:
        os.kill(stubs[0].pid, signal.SIGCONT)
    out: list[bytes] = []
    ended = backend.follow(spec.name, log=log, on_stdout=out.append, on_stderr=None, poll=0.05)
    assert ended == Exited(0, False), b"".join(out)
    assert b"".join(out) == b"task\n"
    assert (ws / "out.txt").read_text() == "out\n"
    assert not psutil.pid_exists(stubs[0].pid) or stubs[0].status() == psutil.STATUS_ZOMBIE
