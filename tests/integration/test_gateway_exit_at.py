"""A task's gateway stops by itself at its exit time (live restore, issue 19).

A detached task's gateway outlives the launcher that started it; nothing of the
launcher's is left to stop it, so it must stop at the task's deadline plus a grace
on its own: a real gateway process, spawned as the launcher spawns it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

import psutil
import pytest

from agentbox.config import Settings
from agentbox.gateway import _process, read_usage
from agentbox.gateway._process import GATEWAY_CGROUP
from agentbox.linux.cgroups import UNIT_KEYS, cgroups_of, unit_hierarchies
from gateway_helpers import spawn_replay_gateway


def test_the_gateway_exits_at_its_exit_time_with_usage_written(
    tmp_path: Path, settings: Settings
) -> None:
    usage = tmp_path / "usage.json"
    exit_at = time.time() + 4.0
    handle, _ = spawn_replay_gateway(tmp_path, settings, exit_at=exit_at)
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


def test_a_launcher_in_a_service_unit_starts_its_gateway_outside_the_unit(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Born outside, not moved after: with the move after the start disabled, the gateway
    (it outlives the launcher, a unit restart too) still runs in ``GATEWAY_CGROUP``, so
    no kill of the unit between its start and a move can reach it."""
    mounts, mine = unit_hierarchies(), cgroups_of("self")
    keys = [k for k in UNIT_KEYS if k in mounts and mine.get(k) == "/"]
    if os.geteuid() != 0 or not keys:
        pytest.skip("needs root at the root of the name=systemd or unified cgroup hierarchy")
    unit = f"agentbox-test-{secrets.token_hex(4)}.service"
    monkeypatch.setattr(_process, "leave_unit_cgroup", lambda pid: [])  # the second line off
    for k in keys:
        (mounts[k] / unit).mkdir()
    try:
        for k in keys:  # this process plays the launcher of a systemd service
            (mounts[k] / unit / "cgroup.procs").write_text("0")
        handle, _ = spawn_replay_gateway(tmp_path, settings, exit_at=time.time() + 120)
        try:
            theirs = cgroups_of(handle.pid)
            assert {k: theirs.get(k) for k in keys} == {k: f"/{GATEWAY_CGROUP}" for k in keys}
            assert "agentbox.gateway" in psutil.Process(handle.pid).cmdline()
        finally:
            handle.stop(grace=1.0)
    finally:
        for k in keys:
            (mounts[k] / "cgroup.procs").write_text("0")
            with contextlib.suppress(OSError):
                (mounts[k] / unit).rmdir()
