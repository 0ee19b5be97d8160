"""End to end on the microVM backend: the real Claude Code binary in a QEMU microVM (its
own kernel, a confined VMM), through the task's gateway streamed over the guest agent's
channel, driven by the built-in ``replay-demo`` script; the result is a branch.

TCG here is ~20x slower than the host, so this is one task, marked ``slow``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from git_helpers import git

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.podman,  # the image is built with podman's storage
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

SAMPLE = Path(__file__).resolve().parents[2] / "demo" / "sample-repo"


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="agentbox-e2e-qemu-", dir="/var/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_task_in_a_microvm(base: Path) -> None:
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
    box = Boxfile.from_dict({"backend": "qemu", "resources": {"cpus": 2, "memory": "2GiB"}})
    launcher = Launcher(settings, max_tasks=1)
    try:
        req = TaskRequest(
            repo=str(repo), task="add slugify and its test, then run the tests",
            model="replay-demo", deadline=900.0, task_id="e2e-qemu",
        )  # fmt: skip
        task_id = launcher.submit(req, boxfile=box).id
        info = launcher.wait(task_id, timeout=1200)
        result = launcher.result(task_id)
    finally:
        launcher.close()
    assert info.status == "done", info.error
    files = git(repo, "ls-tree", "-r", "--name-only", result.branch).split()
    assert "textutil.py" in files and "test_textutil.py" in files
    assert "+def slugify" in result.diff
    # The agent's tests ran inside the guest (log of the agent's session).
    log = (settings.data_dir / "tasks" / task_id / "logs" / "agent.jsonl").read_text()
    assert "Ran 2 tests" in log
    assert info.tokens.input > 0 and info.tokens.output > 0
    # What it used: the QEMU process's own figures (issue 30 §3).
    used = result.report["resources"]
    assert used["source"] == "the VM's process" and used["samples"] > 0, used
    assert used["cpu_s"] > 1 and used["memory_peak_bytes"] > 50_000_000, used
    assert used["disk_written_bytes"] > 0 and used["egress_bytes"] == 0, used
    assert used["processes_peak"] is None  # the guest's processes are not seen from here
    # Nothing of the task survived it: no VMM, jail, gateway or watchdog names its dirs.
    me = os.getpid()
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline", "pid"])
        if p.info["pid"] != me and str(base) in " ".join(p.info["cmdline"] or ())
    ]
    assert left == []
