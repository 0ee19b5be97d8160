"""End to end on the docker backend: the real Claude Code binary in a hardened Docker
container (runc, and runsc/gVisor), through the task's gateway and the in-sandbox relay,
driven by the built-in ``replay-demo`` script; the result is a branch. The task's
sandbox is registered with the leak guard (``sandbox_factory``): no container,
process, cgroup or socket of it may survive the task."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.docker import DockerBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._names import sandbox_name
from git_helpers import git
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.docker,
    pytest.mark.podman,  # the image is built with podman's storage, then imported
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

SAMPLE = Path(__file__).resolve().parents[2] / "demo" / "sample-repo"


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="agentbox-e2e-docker-", dir="/var/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_a_task_in_docker(
    base: Path,
    runtime: str,
    sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker],
) -> None:
    from agentbox.image import build_default

    build_default(Settings())
    (base / "data").mkdir()
    (base / "repos").mkdir()
    settings = Settings(data_dir=base / "data", repos_root=base / "repos")
    repo = base / "repos" / "sample"
    shutil.copytree(SAMPLE, repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "sample")
    box = Boxfile.from_dict({"backend": "docker", "runtime": runtime})
    launcher = Launcher(settings, max_tasks=1)
    task_id = f"e2e-docker-{runtime}"
    docker = DockerBackend(settings)
    sandbox_factory(docker, settings).track(sandbox_name(task_id))  # the launcher makes it
    try:
        req = TaskRequest(
            repo=str(repo), task="add slugify and its test, then run the tests",
            model="replay-demo", deadline=600.0, task_id=task_id,
        )  # fmt: skip
        launcher.submit(req, boxfile=box)
        info = launcher.wait(task_id, timeout=900)
        result = launcher.result(task_id)
    finally:
        launcher.close()
    assert info.status == "done", info.error
    files = git(repo, "ls-tree", "-r", "--name-only", result.branch).split()
    assert "textutil.py" in files and "test_textutil.py" in files
    assert "+def slugify" in result.diff
    log = (settings.data_dir / "tasks" / task_id / "logs" / "agent.jsonl").read_text()
    assert "Ran 2 tests" in log  # the agent's tests ran inside the container
    assert info.tokens.input > 0 and info.tokens.output > 0
    # Nothing of the task survived it: no container of this data dir, no bind point.
    assert docker.owned() == []
    binds = settings.data_dir / "docker-binds"
    assert not binds.exists() or not any(binds.iterdir())
