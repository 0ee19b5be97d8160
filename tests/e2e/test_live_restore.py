"""Live restore with the real parts (issues 19, 32): a launcher killed at random moments
loses no task, runs none twice and leaves nothing behind, on every backend.

``agentbox launcher serve`` runs as a real process; tasks are submitted through one
:class:`LauncherClient` kept across every restart (it rides through them); the agent
is the real Claude Code in a sandbox of each backend (podman under runc and runsc,
docker, qemu), its model the replay model. The
launcher is killed with SIGKILL at random moments, each time one of:

* ``pid``: the launcher process alone (as the OOM killer does);
* ``group``: its whole process group (as a service manager's group kill does);
* ``cgroup``: every process in the launcher's unit cgroup (``systemctl restart``
  under ``KillMode=control-group``), emulated: the launcher runs in a cgroup named
  ``….service`` in the two hierarchies systemd kills a unit by.

and restarted at once. The kills come in phases, one per way: all ``pid`` kills, then
all ``group`` kills, then the ``cgroup`` ones, a few tasks submitted at the start of
each phase so that every phase has agents to hit. Kills are cheap (a short random gap;
most do not wait for anything) but every fourth waits until one of its phase's agents
runs (its sandbox launched), so each way hits running tasks whatever the seed; the
table printed says how many each kill caught. Sizes come from the environment so CI
stays bounded: ``AGENTBOX_CHAOS_WAYS`` (podman runc's phases, default
``pid:8,group:8,cgroup:4``: way and kills; docker's are ``pid:6,group:6,cgroup:2``,
runsc's ``pid:1``, qemu's ``pid:1,group:1``: TCG is slow), ``AGENTBOX_CHAOS_KILLS``
(overrides every phase's count),
``AGENTBOX_CHAOS_TASKS`` (tasks per phase, default 2), ``AGENTBOX_CHAOS_SEED``
(default: random, printed).

Every task's sandbox is registered by name with the leak guard
(:class:`~sandbox_leaks.SandboxTracker`): after the test nothing naming it may remain.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core.paths import TaskPaths
from agentbox.gateway import read_usage
from agentbox.launcher import LauncherClient, TaskRequest
from live_restore_helpers import (
    CHAOS_TASKS,
    CHAOS_WAYS,
    Served,
    World,
    _chaos,
    _git,
    _leftover_processes,
    _our_containers,
    _seed,
    world_of,
)
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]


@pytest.fixture
def world(sandbox_factory: Callable[[Backend, Settings], SandboxTracker]) -> Iterator[World]:
    with world_of(sandbox_factory) as w:
        yield w


@pytest.mark.podman
def test_random_launcher_kills_lose_no_task_and_run_none_twice(world: World) -> None:
    _chaos(world, tasks=CHAOS_TASKS, phases=CHAOS_WAYS, runtime="runc", seed=_seed())


@pytest.mark.podman
def test_a_launcher_kill_on_runsc_loses_no_task(world: World) -> None:
    fac = _host.podman_runtime("runsc")
    if not fac.ok:
        pytest.skip(f"runsc: {fac.detail}")
    _chaos(world, tasks=1, phases=[("pid", 1)], runtime="runsc", seed=_seed())


@pytest.mark.parametrize(
    "engine",
    [pytest.param("podman", marks=pytest.mark.podman),
     pytest.param("docker", marks=pytest.mark.docker)],
)  # fmt: skip
def test_a_deadline_that_passes_while_no_launcher_runs(world: World, engine: str) -> None:
    """The launcher dies; no launcher runs while the deadline passes: the runtime kills
    the sandbox on time (podman: conmon's --timeout; docker: the container's own
    ``timeout`` under tini); the next launcher follows it to that end: timed_out, collected."""
    env = {**world.env, "AGENTBOX_BACKEND": engine}
    served = Served(env, world.sock)
    name = "agentbox-task-live-deadline"
    world.track(engine, ["live-deadline"])
    try:
        with LauncherClient(world.sock) as client:
            info = client.submit(TaskRequest(repo=str(world.repo), task="write, then wait",
                                             model="replay-slow", deadline=30.0,
                                             task_id="live-deadline"))  # fmt: skip
            paths = TaskPaths(world.settings.data_dir, info.id)
            end = time.monotonic() + 180
            while True:
                with contextlib.suppress(Exception):
                    if read_usage(paths.usage_file).requests >= 2:
                        break
                assert time.monotonic() < end, "the agent never got to its long command"
                time.sleep(0.5)
            started = client.get(info.id).started_at
            assert started is not None
        served.kill("pid", None)
        # Nobody follows it now. The runtime (conmon) kills it at its deadline.
        while time.time() < started + 30.0 + 20.0:
            time.sleep(1.0)
        running = subprocess.run([engine, "inspect", "--format", "{{.State.Running}}", name],
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert running in ("false", ""), f"the sandbox outlived its deadline: {running!r}"
        served = Served(env, world.sock)
        with LauncherClient(world.sock) as client:
            info = client.wait("live-deadline", timeout=120)
            assert info.status == "timed_out", info
            res = client.result("live-deadline")
        assert _git(world.repo, "show", f"{res.branch}:partial.txt") == (
            "written before the deadline\n"
        )
        log = (paths.log_dir / "launcher.log").read_text()
        assert "re-adopted by launcher pid" in log, log
    finally:
        served.stop()
    assert _our_containers(world.settings, engine) == []
    assert _leftover_processes(world.settings, {os.getpid()}) == []
