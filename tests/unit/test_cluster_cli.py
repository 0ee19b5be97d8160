"""``agentbox batch status|cancel`` read and write a batch's state file (no Ray needed),
and the live display's tally counts what the driver's events say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.cli import app
from agentbox.cli._batch import Tally
from agentbox.cluster import BatchEvent, BatchState


def _state(root: Path) -> None:
    st = BatchState(root / "b7" / "batch.db")
    try:
        st.init("b7", budget=1000, options={})
        st.add_task("t0", 0, {"repo": "/r", "task": "a"}, "/r", "0" * 40)
        st.add_task("t1", 1, {"repo": "/r", "task": "b"}, "/r", "0" * 40)
        assert st.place("t0", "b7-t0", 600, 1000)
        assert not st.place("t1", "b7-t1", 600, 1000)  # over the batch budget: not placed
    finally:
        st.close()


def test_status_shows_every_task_and_the_committed_tokens(tmp_path: Path) -> None:
    _state(tmp_path)
    res = CliRunner().invoke(app, ["batch", "status", "b7", "--state-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["committed_tokens"] == 600 and doc["budget"] == 1000
    assert [(t["key"], t["state"]) for t in doc["tasks"]] == [("t0", "placed"), ("t1", "queued")]


def test_cancel_sets_the_flag_the_driver_polls(tmp_path: Path) -> None:
    _state(tmp_path)
    res = CliRunner().invoke(app, ["batch", "cancel", "b7", "--state-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    st = BatchState(tmp_path / "b7" / "batch.db")
    try:
        assert st.cancel_requested()
    finally:
        st.close()


def test_an_unknown_batch_is_an_error_naming_it(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["batch", "status", "nope", "--state-dir", str(tmp_path)])
    assert res.exit_code != 0 and "no batch nope" in str(res.exception)


def test_the_tally_follows_placements_losses_and_ends() -> None:
    t = Tally()
    ev = [
        BatchEvent(event="batch", batch="b", detail="3 tasks"),
        BatchEvent(event="placed", batch="b", key="a", attempt_id="b-a"),
        BatchEvent(
            event="placed", batch="b", key="a", attempt_id="b-a", node="n1", detail="running"
        ),
        BatchEvent(event="placed", batch="b", key="c", attempt_id="b-c", node="n2"),
        BatchEvent(event="lost", batch="b", key="c", attempt_id="b-c", node="n2"),
        BatchEvent(
            event="finished",
            batch="b",
            key="a",
            attempt_id="b-a",
            node="n1",
            status="done",
            tokens=42,
        ),
        BatchEvent(event="skipped", batch="b", key="d", attempt_id=""),
    ]
    for e in ev:
        t.add(e)
    assert t.nodes["n1"]["done"] == 1 and t.nodes["n1"]["running"] == 0
    assert t.nodes["n1"]["tokens"] == 42
    assert t.nodes["n2"]["lost"] == 1 and t.nodes["n2"]["running"] == 0
    assert t.queued == 1  # 3, minus two placed, plus the lost one back, minus the skipped


def test_the_cluster_facade_is_pinned() -> None:
    import agentbox.cluster as cluster

    assert sorted(cluster.__all__) == [
        "Attempt", "BatchEvent", "BatchResult", "BatchState", "BatchTask", "Executor",
        "LocalExecutor", "NodeOutcome", "NodeService", "RayExecutor", "batch_dir", "connect",
        "join", "keygen", "leave", "new_batch_id", "node_problems", "read_tasks", "run_batch",
        "start_node",
    ]  # fmt: skip
    for name in cluster.__all__:
        if name in ("RayExecutor", "connect", "start_node"):
            pytest.importorskip("ray", reason="the agentbox[ray] extra is not installed")
        assert getattr(cluster, name) is not None


def test_a_batch_with_no_cluster_says_what_to_do_not_a_traceback(tmp_path: Path) -> None:
    """No Ray cluster at the address → one line naming the fix (start a head and a node,
    or --address), exit non-zero, no Ray traceback."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("ray", reason="the agentbox[ray] extra is not installed")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"repo": str(tmp_path), "task": "x"}) + "\n")
    got = subprocess.run(
        [sys.executable, "-m", "agentbox", "batch", "run", str(tasks),
         "--address", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "b")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert got.returncode != 0
    assert "Traceback" not in got.stderr, got.stderr
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in got.stderr
    assert "agentbox node start --head" in got.stderr and "--address" in got.stderr


def test_status_shows_each_tasks_cost_and_the_total(tmp_path: Path) -> None:
    """Issue 27: dollars beside tokens, per task and in total; unknown is never $0."""
    _state(tmp_path)
    st = BatchState(tmp_path / "b7" / "batch.db")
    try:
        st.update("t0", state="published", status="done", tokens=500, cost_usd=0.0125)
        st.update("t1", state="published", status="done", tokens=300, cost_usd=0.0075)
    finally:
        st.close()
    args = ["batch", "status", "b7", "--state-dir", str(tmp_path)]
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert [t["cost_usd"] for t in doc["tasks"]] == [0.0125, 0.0075]
    assert doc["cost_usd_total"] == pytest.approx(0.02)
    out = CliRunner().invoke(app, args, env={"COLUMNS": "200"}).output
    assert "$0.0125" in out and "cost $0.0200" in out
    st = BatchState(tmp_path / "b7" / "batch.db")
    try:
        st.update("t1", cost_usd=None)  # a model without prices
    finally:
        st.close()
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert doc["cost_usd_total"] is None
    assert "1 task(s) price unknown" in CliRunner().invoke(app, args, env={"COLUMNS": "200"}).output
