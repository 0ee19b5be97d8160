"""The orphan sweep (a foreground ``agentbox run`` at its start, a restarted launcher)
logs only the sandboxes it removed: a microVM whose owner is alive (another process's
exec or shell) is listed, left be by its backend, and not reported as removed."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import LABEL
from agentbox.config import Settings
from agentbox.launcher import _adopt
from agentbox.launcher._store import Store


@pytest.fixture
def live_owner() -> Iterator[int]:
    """Another process, alive for the test."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _vm_dir(settings: Settings, vm: str, sandbox: str, pid: int) -> Path:
    d = settings.data_dir / "microvm" / vm
    d.mkdir(parents=True)
    (d / "owner").write_text(json.dumps({LABEL: sandbox, "pid": pid}))
    return d


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_live_microvm_of_another_process_is_not_logged_as_removed(
    settings: Settings, tmp_path: Path, live_owner: int, capfd: pytest.CaptureFixture[str]
) -> None:
    live = _vm_dir(settings, "vm-live", "agentbox-task-t-live", live_owner)
    dead = _vm_dir(settings, "vm-dead", "agentbox-task-t-dead", _dead_pid())

    _adopt.remove_orphans(settings, Store(tmp_path / "state.db"))

    err = capfd.readouterr().err
    assert live.is_dir() and not dead.exists()
    lines = [line for line in err.splitlines() if "orphan sandbox" in line]
    assert len(lines) == 1 and "agentbox-task-t-dead" in lines[0], err
    assert "agentbox-task-t-live" not in err
