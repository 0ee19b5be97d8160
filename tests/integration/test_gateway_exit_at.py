"""A task's gateway stops by itself at its exit time (live restore, issue 19).

A detached task's gateway outlives the launcher that started it; nothing of the
launcher's is left to stop it, so it must stop at the task's deadline plus a grace
on its own: a real gateway process, spawned as the launcher spawns it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import psutil

from agentbox.config import Settings
from agentbox.gateway import read_usage, spawn_gateway
from gateway_helpers import CHAT_SCRIPT, write_script


def test_the_gateway_exits_at_its_exit_time_with_usage_written(
    tmp_path: Path, settings: Settings
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(24))
    token_file.chmod(0o600)
    usage = tmp_path / "usage.json"
    exit_at = time.time() + 4.0
    handle = spawn_gateway(
        socket_path=tmp_path / "gw.sock",
        token_file=token_file,
        model="replay-demo",
        budget=50_000,
        usage_file=usage,
        settings=settings,
        replay_script=write_script(tmp_path, CHAT_SCRIPT),
        log_file=tmp_path / "gw.log",
        exit_at=exit_at,
    )
    try:
        proc = psutil.Process(handle.pid)
        assert "--exit-at" in proc.cmdline()
        assert handle.alive()
        # Nobody stops it: it must go by itself, shortly after its exit time.
        end = time.monotonic() + 60
        while handle.alive() and time.monotonic() < end:
            time.sleep(0.1)
        code = handle.returncode
        assert time.time() >= exit_at - 0.5
        assert code == 0, (tmp_path / "gw.log").read_text(errors="replace")[-2000:]
        assert read_usage(usage).budget == 50_000
        assert not (tmp_path / "gw.sock").exists()
    finally:
        handle.stop(grace=1.0)
