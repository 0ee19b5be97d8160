"""What a launcher that died mid-task leaves of the environment is cleaned by the next one:
its egress proxies (only if still the same process) and the task's overlay mount."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from agentbox.config import Settings
from agentbox.egress import EgressPolicy
from agentbox.env import EnvMount, release_task_env, start_egress

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts and proxies need root")


def _task_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="envorphan-", dir="/var/tmp"))
    root.chmod(0o711)
    (root / "logs").mkdir()
    (root / "net").mkdir()
    return root


def test_release_task_env_ends_a_recorded_proxy_and_unmounts_the_overlay() -> None:
    root = _task_root()
    settings = Settings()
    egress = start_egress(
        settings, EgressPolicy(), root / "net", root / "logs" / "egress.jsonl", None
    )
    lower = root / "frozen"
    (lower / ".venv").mkdir(parents=True)
    (lower / ".venv" / "f").write_text("frozen\n")
    ws = root / "ws"
    ws.mkdir()
    overlay = EnvMount(lower, root / "env")
    try:
        overlay.mount(ws, [".venv"], os.getuid())
        assert os.path.ismount(root / "env" / "merged")
        assert egress.proxy.alive()
        assert (root / "egress-ca" / "ca.pem").stat().st_mode & 0o777 == 0o444
        # The launcher "dies" here: nothing of it calls stop() or release().
        release_task_env(root)
        for _ in range(50):
            if not egress.proxy.alive():
                break
            time.sleep(0.1)
        assert not egress.proxy.alive()
        assert not (root / "env").exists()
        assert (lower / ".venv" / "f").read_text() == "frozen\n"  # the lower layer is intact
    finally:
        egress.proxy.stop(grace=0.5)
        overlay.release()
        shutil.rmtree(root, ignore_errors=True)


def test_a_recorded_pid_reused_by_another_process_is_left_alone() -> None:
    root = _task_root()
    me = psutil.Process()
    # Our own pid with a start time that is not ours: must not be killed.
    (root / "egress-proxies").write_text(f"{me.pid} {me.create_time() - 100.0!r}\n")
    release_task_env(root)
    assert me.is_running()
    shutil.rmtree(root, ignore_errors=True)
