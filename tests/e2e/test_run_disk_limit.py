"""End to end: a task whose agent fills its disk still gets its work collected (issue 11.6).

The real Claude Code binary in a podman sandbox whose Boxfile asks for a
128 MiB workspace disk; its agent writes a file, then (with the Bash tool)
tries to write 1 GiB. Inside, that fails with ENOSPC; the task still ends
``done`` with the file it wrote on its branch; nothing of the disk is left
on the host (no mount, no loop device, no image). ``agentbox rm`` then removes
the task and leaves the published branch in the repo.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

FILL_SCRIPT = """\
name: fill
turns:
  - text: "First the real work."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/partial.txt", content: "written before the disk filled\\n"}
  - text: "Now fill the disk."
    tool_use:
      - name: Bash
        input:
          command: >-
            fallocate -l 1G big.bin || echo FULL;
            dd if=/dev/zero of=dd.bin bs=1M count=300 2>&1 | tail -1;
            rm -f big.bin; echo filled
          description: "Try to fill the disk"
  - match: "filled"
    text: "The disk is full; stopping."
"""


def test_a_task_that_fills_its_disk_is_still_collected() -> None:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-disk-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        (base / "fill.yaml").write_text(FILL_SCRIPT)
        (base / "models.toml").write_text(
            '[models.replay-fill]\nkind = "replay"\nupstream = "fill.yaml"\n'
        )
        for d in ("data", "repos"):
            (base / d).mkdir()
        settings = Settings(
            data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
        )
        repo = settings.repos_root / "proj"
        repo.mkdir()
        (repo / "README.md").write_text("proj\n")
        git(repo, "init", "-q", "-b", "main")
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
        box = Boxfile.from_dict({"resources": {"disk": "128MiB", "cpus": 1, "memory": "1GiB"}})
        with Launcher(settings, max_tasks=1) as launcher:
            req = TaskRequest(repo=str(repo), task="fill the disk", model="replay-fill",
                              deadline=300.0)  # fmt: skip
            task_id = launcher.submit(req, boxfile=box).id
            info = launcher.wait(task_id, timeout=600)
            res = launcher.result(task_id)
        assert info.status == "done", info.error
        log = (settings.data_dir / "tasks" / task_id / "logs" / "agent.jsonl").read_text()
        assert "No space left on device" in log and "FULL" in log
        branch = f"agentbox/{task_id}"
        assert res.branch == branch
        assert git(repo, "show", f"{branch}:partial.txt") == "written before the disk filled\n"
        assert "partial.txt" in res.diff
        # Nothing of the disk is left on the host.
        ws = settings.data_dir / "tasks" / task_id / "workspace"
        assert not os.path.ismount(ws)
        # The loop device goes with the filesystem's last user: the container's mount
        # namespace may outlive `podman run --rm` by a moment.
        for _ in range(100):
            loops = subprocess.run(
                ["losetup", "-n", "-O", "BACK-FILE"], capture_output=True, text=True
            ).stdout
            if str(settings.data_dir) not in loops:
                break
            time.sleep(0.1)
        assert str(settings.data_dir) not in loops
        assert list((settings.data_dir / "disks").iterdir()) == []
        # Retention: the task goes, its published branch stays.
        env = {"PATH": os.environ["PATH"], "AGENTBOX_DATA_DIR": str(settings.data_dir),
               "AGENTBOX_CONFIG": "/nonexistent.toml"}  # fmt: skip
        rm = subprocess.run([sys.executable, "-m", "agentbox", "rm", task_id],
                            capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert rm.returncode == 0, rm.stderr
        assert not (settings.data_dir / "tasks" / task_id).exists()
        assert git(repo, "branch", "--list", branch).strip()
    finally:
        shutil.rmtree(base, ignore_errors=True)
