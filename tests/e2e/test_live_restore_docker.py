"""Live restore of docker tasks: random launcher kills (see test_live_restore.py) and a
dockerd restart with the daemon's live-restore."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.gateway import read_usage
from agentbox.launcher import LauncherClient, TaskRequest
from live_restore_helpers import (
    CHAOS_KILLS,
    CHAOS_TASKS,
    DOCKER_WAYS,
    Served,
    World,
    _chaos,
    _git,
    _launches,
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


@pytest.mark.docker
def test_random_launcher_kills_on_docker_lose_no_task(world: World) -> None:
    """Docker tasks outlive their launcher too (issue 32): the Engine holds the
    container; the next launcher checks its seal and re-adopts it."""
    ways = [(w, int(CHAOS_KILLS or n)) for w, n in DOCKER_WAYS]
    _chaos(world, tasks=CHAOS_TASKS, phases=ways, runtime="runc", seed=_seed(), backend="docker")


def _dockerd() -> psutil.Process | None:
    """The running dockerd, if there is exactly one."""
    found = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "dockerd"]
    return found[0] if len(found) == 1 else None


def _docker_state(name: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Running}} {{.State.Pid}} {{.State.StartedAt}}",
         name], capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip


def _restart_dockerd(proc: psutil.Process) -> None:
    """Stop dockerd (SIGTERM, as a service manager does) and start it again with the same
    command line and log, as scripts/setup.sh starts it; back once it answers."""
    argv = proc.cmdline()
    proc.terminate()
    proc.wait(60)
    # As setup.sh does: its own session, its parent gone at once (init reaps it).
    subprocess.run(["sh", "-c", 'setsid nohup "$@" >>/var/log/agentbox-dockerd.log 2>&1 '
                    "</dev/null &", "sh", *argv], check=True, timeout=60)  # fmt: skip
    end = time.monotonic() + 60
    while subprocess.run(["docker", "version"], capture_output=True).returncode != 0:
        assert time.monotonic() < end, "dockerd did not come back"
        time.sleep(0.2)


@pytest.mark.docker
def test_a_dockerd_restart_with_live_restore_loses_no_task(world: World) -> None:
    """dockerd restarts while a docker task's agent runs (its launcher stays): with the
    daemon's live-restore (scripts/setup.sh sets it) the container runs on, the same
    process, and the follower reconnects its log stream and wait: the task ends done,
    its output whole, its sandbox created once. The restart is kept short (other docker
    tests share the daemon: this test runs in the serial pass, tests/conftest.py)."""
    info = subprocess.run(["docker", "info", "--format", "{{.LiveRestoreEnabled}}"],
                          capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    dockerd = _dockerd()
    if info != "true" or dockerd is None:
        pytest.skip(f"dockerd's live-restore is {info or 'unknown'} (scripts/setup.sh sets it)")
    env = {**world.env, "AGENTBOX_BACKEND": "docker"}
    tid, name = "live-dockerd", "agentbox-task-live-dockerd"
    world.track("docker", [tid])
    served = Served(env, world.sock)
    try:
        with LauncherClient(world.sock, reconnect=90.0) as client:
            req = TaskRequest(repo=str(world.repo), task="write, work", model="replay-chaos",
                              deadline=600.0, task_id=tid)  # fmt: skip
            client.submit(req)
            paths = TaskPaths(world.settings.data_dir, tid)
            end = time.monotonic() + 300
            while True:  # the agent runs: it has asked the model already
                with contextlib.suppress(Exception):
                    if read_usage(paths.usage_file).requests >= 1:
                        break
                assert client.get(tid).status in ("queued", "running"), client.get(tid)
                assert time.monotonic() < end, "the agent never came to run"
                time.sleep(0.2)
            before = _docker_state(name)
            assert before.startswith("true "), before
            _restart_dockerd(dockerd)
            # The same process, started once: it lived on (or ended since, and was removed).
            assert _docker_state(name) in (before, ""), "the container did not live on"
            info = client.wait(tid, timeout=300)
            assert info.status == "done", (info.status, info.error)
            res = client.result(tid)
        assert _git(world.repo, "show", f"{res.branch}:chaos.txt") == "made by the agent\n"
        out = (paths.log_dir / "agent.jsonl").read_text()
        assert out.count('"subtype":"init"') == 1 and '"type":"result"' in out
        log = (paths.log_dir / "launcher.log").read_text()
        assert "re-adopted" not in log, log  # the same launcher followed it throughout
        # Started once (dockerd's event history does not outlive its restart).
        assert _launches(world.settings, tid) == 1
    finally:
        served.stop()
    assert _our_containers(world.settings, "docker") == []
    assert _leftover_processes(world.settings, {os.getpid()}) == []
