"""The orphan sweep lists what runs before it reads the records.

Another launcher on the same data dir records a task (its sandbox's name included)
and only then starts its gateway and sandbox. A sweep that read the records first and
listed the running sandboxes after could find one started in between, with no record
it had read, and reap a live task's sandbox and gateway (a foreground ``agentbox run``
sweeps while the service runs tasks). Here the other launcher starts its task exactly
then: while the sweep lists.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.launcher import _adopt
from agentbox.launcher._store import Owner, Store


def _start_elsewhere(store: Store, task_id: str, sandbox: str) -> None:
    """What another (live) launcher does before it starts a task's gateway and sandbox."""
    store.insert(
        id=task_id, status="queued", repo="/r", task="x", model="m", budget=10, deadline=60.0,
        created_at=1.0, owner_pid=os.getpid(), owner_start=Owner.me().start,
    )  # fmt: skip
    store.update(task_id, expect={"queued"}, status="running", sandbox=sandbox, stage="launched")


def test_a_task_started_while_the_sweep_lists_is_not_an_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    store = Store(tmp_path / "state.db")
    gw = Owner(os.getpid(), Owner.me().start)
    reaped: list[str] = []

    def listing(_settings: Settings) -> list[tuple[str, str]]:
        # Started (recorded first) while this sweep lists: now it runs, listed.
        _start_elsewhere(store, "t-new", "agentbox-task-t-new")
        return [("podman", "agentbox-task-t-new"), ("podman", "agentbox-task-t-gone")]

    monkeypatch.setattr(_adopt, "owned_sandboxes", listing)
    monkeypatch.setattr(_adopt, "list_task_gateways", lambda s: [("t-new", gw), ("t-gone", gw)])
    monkeypatch.setattr(_adopt, "reap_sandbox", lambda backend, name, data: reaped.append(name))
    monkeypatch.setattr(_adopt, "kill_gateway", lambda g: reaped.append(f"gateway {g.pid}"))

    _adopt.remove_orphans(settings, store)

    # The one no record holds is reaped (its gateway too); the new task's are not.
    assert reaped == ["agentbox-task-t-gone", f"gateway {gw.pid}"]


def test_a_live_tasks_setup_sandbox_is_not_an_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34 item 3: a task in its [setup] phase is queued with no sandbox recorded
    yet (the agent's name is recorded at its launch); its setup sandbox, labelled with
    the data dir, was reaped by any sweep that listed meanwhile (this run's own, on a
    busy host, or another launcher's), and setup ended with exit 137."""
    settings = Settings(data_dir=tmp_path / "data")
    store = Store(tmp_path / "state.db")
    store.insert(
        id="t-setup", status="queued", repo="/r", task="x", model="m", budget=10,
        deadline=60.0, created_at=1.0, owner_pid=os.getpid(), owner_start=Owner.me().start,
    )  # fmt: skip
    store.insert(
        id="t-dead", status="queued", repo="/r", task="x", model="m", budget=10,
        deadline=60.0, created_at=1.0, owner_pid=2**22 + 1, owner_start=1.0,
    )  # fmt: skip
    reaped: list[str] = []
    listed = [("podman", "agentbox-setup-t-setup"), ("podman", "agentbox-setup-t-dead")]
    monkeypatch.setattr(_adopt, "owned_sandboxes", lambda s: listed)
    monkeypatch.setattr(_adopt, "list_task_gateways", lambda s: [])
    monkeypatch.setattr(_adopt, "reap_sandbox", lambda backend, name, data: reaped.append(name))

    _adopt.remove_orphans(settings, store)

    assert reaped == ["agentbox-setup-t-dead"]  # its launcher is gone: an orphan


def test_an_exit_code_above_128_says_the_signal_and_why() -> None:
    from agentbox.core.exitwords import exit_words, kill_cause

    assert exit_words(1) == "exit 1"
    oom = kill_cause(timed_out=False, cancelled=False, oom_before=3, oom_after=4)
    assert exit_words(137, oom) == (
        "exit 137: killed by SIGKILL (out of memory: the kernel's OOM killer ran while it did)"
    )
    assert "deadline" in kill_cause(timed_out=True, cancelled=False, oom_before=3, oom_after=4)
    assert "no OOM kill" in kill_cause(timed_out=False, cancelled=False, oom_before=3, oom_after=3)
    assert exit_words(143) == "exit 143: killed by SIGTERM"
