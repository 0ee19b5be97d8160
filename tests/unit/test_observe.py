"""Phases with exact times (``logs/phases.jsonl``), the metrics' listen address, the
traces' switch: pure, no launcher."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentbox.errors import PolicyRefused
from agentbox.launcher.metrics import parse_listen
from agentbox.observe.phases import PHASES_FILE, task_phases
from agentbox.observe.traces import traces_enabled


def _write(log_dir: Path, lines: list[tuple[float, str]]) -> Path:
    log_dir.mkdir(exist_ok=True)
    (log_dir / PHASES_FILE).write_text(
        "".join(json.dumps({"t": t, "msg": m}) + "\n" for t, m in lines)
    )
    return log_dir


def test_the_five_phases_add_up_to_the_whole(tmp_path: Path) -> None:
    log = _write(tmp_path / "logs", [
        (100.0, "starting the gateway (model m, budget 1)"),
        (100.5, "preparing the workspace from /r"),
        (101.0, "running setup (2 command(s), deadline 600s)"),
        (111.0, "setup done in 10.0s; freezing what it made"),
        (112.0, "running claude in sandbox agentbox-task-x (deadline 3600s)"),
        (140.0, "agent exited with code 0 after 28.0s"),
        (140.2, "collecting the workspace"),
        (141.0, "published agentbox/x"),
        (141.5, "finished: done"),
    ])  # fmt: skip
    p = task_phases(log, created_at=99.0)
    got = {s.name: round(s.seconds, 3) for s in p.spans}
    assert got == {"queue": 1.0, "setup": 10.0, "start": 2.0, "agent": 28.0, "collect": 1.3}
    assert p.finished and p.readoptions == 0
    assert round(sum(got.values()), 3) == 141.5 - 99.0 - 0.2  # all but agent exit -> collect


def test_a_readopted_task_without_setup(tmp_path: Path) -> None:
    log = _write(tmp_path / "logs", [
        (10.0, "starting the gateway (model m, budget 1)"),
        (12.0, "running claude in sandbox s, detached (deadline 60s)"),
        (20.0, "re-adopted by launcher pid 42: following sandbox s"),
        (30.0, "agent exited with code 0"),
        (31.0, "collecting the workspace"),
        (32.0, "finished: done"),
    ])  # fmt: skip
    p = task_phases(log, created_at=10.0)
    assert [s.name for s in p.spans] == ["queue", "start", "agent", "collect"]
    assert p.get("setup") is None and p.readoptions == 1
    agent = p.get("agent")
    assert agent is not None and agent.seconds == 18.0


def test_hostile_or_missing_files_give_no_phases(tmp_path: Path) -> None:
    assert task_phases(tmp_path, created_at=1.0).spans == ()
    log = tmp_path / "logs"
    log.mkdir()
    (log / PHASES_FILE).write_bytes(
        b'{"t": "x", "msg": 1}\n[1,2]\n\xff\xfe\n{"t": true, "msg": "finished: done"}\n'
    )
    assert task_phases(log, created_at=1.0).spans == ()
    (log / PHASES_FILE).unlink()
    os.symlink("/etc/passwd", log / PHASES_FILE)
    assert task_phases(log, created_at=1.0).spans == ()


def test_metrics_listen_only_on_loopback() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in (
        "0.0.0.0:9464",
        "10.0.0.1:80",
        "[::]:9464",
        "9464",
        "127.0.0.1:x",
        "127.0.0.1:70000",
    ):
        with pytest.raises(PolicyRefused):
            parse_listen(bad)


def test_traces_are_off_unless_a_collector_is_named() -> None:
    assert not traces_enabled({})
    assert not traces_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    assert traces_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert traces_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
