"""What a task used (issue 30 §3), with the real Claude Code on podman.

The agent (a replay script) writes ``burn.py`` and runs it: it holds ~100 MB of memory,
writes 50 MB to the workspace (fsynced), spins the CPU for 3 s, naps 6 s and removes
its file. While it naps, ``agentbox tasks --json`` shows live, non-zero figures; once it
ended, the report's ``resources`` say cpu >= 2 s, peak memory >= 100 MB, disk written
>= 50 MB, egress 0, and ``show --json`` and ``tasks --json`` carry the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from git_helpers import git
from task_cleanup import sweep

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

BURN = """\
import os, time
hog = b"\\x01" * (100 << 20)
with open("big.bin", "wb") as f:
    for _ in range(50):
        f.write(os.urandom(1 << 20))
    f.flush()
    os.fsync(f.fileno())
end = time.time() + 3
n = 0
while time.time() < end:
    n += 1
time.sleep(6)
print("burned", len(hog), n)
"""

SCRIPT = """\
name: burner
turns:
  - text: "Writing the burner."
    tool_use:
      - name: Write
        input:
          file_path: "{{cwd}}/burn.py"
          content: CONTENT
  - text: "Running it."
    tool_use:
      - name: Bash
        input:
          command: "python3 burn.py && rm -f big.bin burn.py && echo burnt"
          description: burn
          timeout: 120000
  - match: "burnt"
    text: "Done."
""".replace("CONTENT", json.dumps(BURN))

MB = 1_000_000


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def _task(env: dict[str, str], task_id: str) -> dict[str, Any]:
    r = _cli(env, "tasks", "--json")
    assert r.returncode == 0, r.stderr
    (task,) = [t for t in json.loads(r.stdout)["tasks"] if t["id"] == task_id]
    return task  # type: ignore[no-any-return]


def test_a_tasks_cpu_memory_disk_and_egress() -> None:
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-resources-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    (base / "burner.yaml").write_text(SCRIPT)
    (base / "models.toml").write_text(
        'default = "burner"\n[models.burner]\nkind = "replay"\nupstream = "burner.yaml"\n'
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "launcher listening on" in line:
                break
        else:
            pytest.fail("the launcher never said it listens")
        repo = base / "repos" / "r"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "README.md").write_text("hi\n")
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
        r = _cli(env, "run", "--detach", "--json", "--repo", str(repo), "Burn some CPU")
        assert r.returncode == 0, (r.stdout, r.stderr)
        task_id = json.loads(r.stdout)["id"]

        # While it runs: live figures, read from the sandbox's cgroup and disk.
        live: dict[str, Any] = {}
        end = time.monotonic() + 240
        while time.monotonic() < end:
            task = _task(env, task_id)
            live = task.get("resources") or {}
            if task["status"] not in ("queued", "running") or (
                live.get("live") and (live.get("cpu_s") or 0) >= 1
            ):  # queued: a detached run returns before its task starts
                break
            time.sleep(1)
        assert task["status"] == "running", task
        assert live.get("live") is True, live
        assert live["cpu_s"] >= 1 and live["memory_peak_bytes"] > 50 * MB, live
        assert live["processes_peak"] >= 2, live

        w = _cli(env, "wait", task_id, "--json", "--timeout", "300")
        assert w.returncode == 0, (w.stdout, w.stderr)
        report = json.loads((base / "data" / "tasks" / task_id / "report.json").read_text())
        assert report["status"] == "done", report.get("error")
        used = report["resources"]
        print("resources:", json.dumps(used))
        assert used["live"] is False
        assert used["cpu_s"] >= 2, used
        assert used["memory_peak_bytes"] >= 100 * MB, used
        assert used["memory_anon_peak_bytes"] >= 100 * MB, used
        # the processes' own writes: the 50 MB, not the filesystem's lazy init of its
        # inode tables (which the loop device's figure carries too)
        assert 50 * MB <= used["disk_written_bytes"] < 150 * MB, used
        assert used["disk_device_written_bytes"] >= 50 * MB, used
        assert used["disk_peak_bytes"] >= 50 * MB, used
        assert used["processes_peak"] >= 2 and used["processes_seen"] >= 3, used
        assert used["processes_started"] is None  # no fork counter: not claimed
        assert used["egress_bytes"] == 0, used

        s = _cli(env, "show", task_id, "--json", "--no-diff")
        assert s.returncode == 0, s.stderr
        shown = json.loads(s.stdout)
        assert shown["result"]["report"]["resources"] == used
        assert shown["task"]["resources"] == used
        assert _task(env, task_id)["resources"] == used
        text = _cli(env, "show", task_id, "--no-diff").stdout
        assert "resources" in text and "cpu " in text and "disk written" in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        sweep(base, env)
        shutil.rmtree(base, ignore_errors=True)
