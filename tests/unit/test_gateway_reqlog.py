"""The gateway's request ledger (``requests.jsonl``) and the transcript's per-turn tokens.

The ledger is written by the gateway, but a crash or the cap can cut it mid-line and a
bug could write a bad line: the reader skips what is not a whole record and never raises.
The transcript joins each agent turn (assistant message id) to its record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentbox.gateway import _reqlog, read_requests
from agentbox.gateway._meter import StreamMeter, TokenCount
from agentbox.gateway._reqlog import LEDGER_NAME, RequestLog, ledger_path
from agentbox.transcript import read_transcript


def _write(tmp_path: Path, n: int) -> RequestLog:
    w = RequestLog(None, tmp_path)
    for i in range(n):
        w.append(message_id=f"msg_{i}", model="m", counts=TokenCount(10 + i, 2, 3, 4),
                 status=200, stop_reason="end_turn", complete=True)  # fmt: skip
    return w


def test_round_trip(tmp_path: Path) -> None:
    _write(tmp_path, 3).close()
    recs = read_requests(tmp_path / "usage.json")
    assert [r.message_id for r in recs] == ["msg_0", "msg_1", "msg_2"]
    assert (recs[1].input, recs[1].output, recs[1].cache_creation, recs[1].cache_read) == (
        11, 2, 3, 4)  # fmt: skip
    assert recs[0].status == 200 and recs[0].stop_reason == "end_turn" and recs[0].complete


def test_truncated_and_corrupt_lines_are_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 3).close()
    path = tmp_path / LEDGER_NAME
    data = path.read_bytes()
    bad = [
        b"not json",
        b"[1,2]",
        json.dumps(
            {
                "time": 1,
                "input": -1,
                "output": 0,
                "cache_creation": 0,
                "cache_read": 0,
                "status": 200,
            }
        ).encode(),
        json.dumps(
            {
                "time": 1,
                "input": True,
                "output": 0,
                "cache_creation": 0,
                "cache_read": 0,
                "status": 200,
            }
        ).encode(),
        json.dumps(
            {
                "time": "x",
                "input": 1,
                "output": 0,
                "cache_creation": 0,
                "cache_read": 0,
                "status": 200,
            }
        ).encode(),
        b"[" * 100_000,
    ]
    # A cut last line (a crash mid-write) is not a record either.
    path.write_bytes(data + b"\n".join(bad) + b"\n" + data[: len(data) // 3 * 2 + 5])
    recs = read_requests(tmp_path / "usage.json")
    # The cut copy's two whole lines are read; its third, cut in half, is not.
    assert [r.message_id for r in recs] == ["msg_0", "msg_1", "msg_2", "msg_0", "msg_1"]
    # A bad message id or stop reason is dropped, the counts kept.
    path.write_bytes(json.dumps({"time": 1, "message_id": "a\nb" * 300, "input": 5, "output": 1,
                                 "cache_creation": 0, "cache_read": 0, "status": 200,
                                 "stop_reason": {"x": 1}}).encode() + b"\n")  # fmt: skip
    (rec,) = read_requests(tmp_path / "usage.json")
    assert rec.message_id is None and rec.stop_reason is None and rec.input == 5


def test_missing_fifo_and_link_are_not_read(tmp_path: Path) -> None:
    assert read_requests(tmp_path / "usage.json") == []
    os.mkfifo(tmp_path / LEDGER_NAME)
    assert read_requests(tmp_path / "usage.json") == []  # never blocks on a FIFO
    os.unlink(tmp_path / LEDGER_NAME)
    other = tmp_path / "elsewhere"
    other.mkdir()
    _write(other, 1).close()
    (tmp_path / LEDGER_NAME).symlink_to(other / LEDGER_NAME)
    assert read_requests(tmp_path / "usage.json") == []  # O_NOFOLLOW


def test_confined_state_dir_is_found_through_the_usage_link(tmp_path: Path) -> None:
    state = tmp_path / "usage.json.d"
    state.mkdir()
    (state / "usage.json").write_text("{}")
    (tmp_path / "usage.json").symlink_to("usage.json.d/usage.json")
    assert ledger_path(tmp_path / "usage.json") == state / LEDGER_NAME
    _write(state, 2).close()
    assert len(read_requests(tmp_path / "usage.json")) == 2
    # A link that leaves the task dir is not followed to find a ledger.
    (tmp_path / "usage.json").unlink()
    (tmp_path / "usage.json").symlink_to("/etc/passwd")
    assert ledger_path(tmp_path / "usage.json") == tmp_path / LEDGER_NAME


def test_the_cap_stops_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reqlog, "MAX_RECORDS", 5)
    _write(tmp_path, 9).close()
    assert len(read_requests(tmp_path / "usage.json")) == 5
    monkeypatch.setattr(_reqlog, "MAX_RECORDS", 10_000)
    monkeypatch.setattr(_reqlog, "MAX_BYTES", 1000)
    _write(tmp_path, 50).close()  # a new gateway starts the ledger again, as usage.json
    assert (tmp_path / LEDGER_NAME).stat().st_size <= 1000
    assert 0 < len(read_requests(tmp_path / "usage.json")) < 50


def test_stream_meter_reads_id_model_and_stop_reason() -> None:
    m = StreamMeter()
    start = {"type": "message_start", "message": {"id": "msg_x", "model": "claude-y",
             "usage": {"input_tokens": 3, "output_tokens": 1}}}  # fmt: skip
    delta = {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
             "usage": {"output_tokens": 9}}  # fmt: skip
    for ev in (start, delta, {"type": "message_stop"}):
        m.feed(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode())
    assert (m.message_id, m.model, m.stop_reason) == ("msg_x", "claude-y", "tool_use")
    assert (m.count.input, m.count.output) == (3, 9)


def _assistant(mid: str, *blocks: dict[str, object]) -> str:
    msg = {"id": mid, "content": list(blocks)}
    return json.dumps({"type": "assistant", "message": msg, "timestamp": "2026-12-01T12:00:00Z"})


def test_transcript_carries_each_turns_tokens_once(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    tool = {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}
    lines = [
        _assistant("msg_1", {"type": "text", "text": "Looking."}),
        _assistant("msg_1", tool),  # the same turn, a second line: no second count
        _assistant("msg_2", {"type": "text", "text": "Done."}),
        _assistant("msg_3", {"type": "text", "text": "No record for this one."}),
    ]
    (tmp_path / "logs" / "agent.jsonl").write_text("".join(x + "\n" for x in lines))
    w = RequestLog(None, tmp_path)
    for mid, n in (("msg_side", 1), ("msg_1", 100), ("msg_2", 200)):
        w.append(message_id=mid, model="m", counts=TokenCount(n, n // 10, 0, 5), status=200,
                 stop_reason="end_turn", complete=True)  # fmt: skip
    w.close()
    # A ledger cut mid-line: the last record is lost, nothing else.
    path = tmp_path / LEDGER_NAME
    path.write_bytes(path.read_bytes() + b'{"time": 1, "message_id": "msg_3", "inp')
    t = read_transcript(tmp_path)
    with_tokens = [(e.message_id, e.kind, e.tokens.input) for e in t.events if e.tokens]
    assert with_tokens == [("msg_1", "text", 100), ("msg_2", "text", 200)]
    assert [(x.message_id, x.in_transcript) for x in t.turn_tokens] == [
        ("msg_side", False), ("msg_1", True), ("msg_2", True)]  # fmt: skip
    assert sum(x.tokens.input for x in t.turn_tokens) == 301
    assert all(e.message_id for e in t.events if e.kind in ("text", "tool_call"))
