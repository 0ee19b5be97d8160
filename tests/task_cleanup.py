"""Teardown for tests that run tasks through the CLI's own processes (``run``, ``--detach``).

With live restore a task's sandbox runs detached: a test that fails half-way (a ``run``
killed, a launcher stopped with ``leave``) would leave a container, its workspace disk
and its gateway running after the test's data dir is gone. :func:`sweep` stops the
launcher serving the data dir (cancelling and collecting its tasks), kills any process
still naming the test's base dir (a ``run``, a waiter) and reaps whatever sandbox or
gateway of that data dir no live task holds, the way a starting launcher does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from agentbox.config import Settings


def sweep(base: Path, env: dict[str, str]) -> None:
    """Leave nothing of the tasks of ``base/data`` running (idempotent)."""
    subprocess.run(
        [sys.executable, "-m", "agentbox", "launcher", "stop", "--cancel"],
        env=env, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] != me and str(base) in cmd and "agentbox" in cmd:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
    time.sleep(0.5)
    from agentbox.launcher._adopt import remove_orphans
    from agentbox.launcher._store import Store

    settings = Settings(data_dir=base / "data", repos_root=base / "repos")
    if (settings.data_dir / "state.db").exists():
        remove_orphans(settings, Store(settings.data_dir / "state.db"))
