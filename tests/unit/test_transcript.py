"""The transcript parser on a real Claude Code stream-json (recorded from a replay-demo
task) and on hostile input: malformed, deep, huge, FIFOs, heartbeats; it never raises."""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentbox.transcript import MAX_LINE_BYTES, is_test_command, parse_agent_jsonl, read_transcript

DATA = Path(__file__).parent / "data"
REAL = DATA / "claude-code-demo.jsonl"


def _task(tmp_path: Path, lines: list[str] | None = None) -> Path:
    (tmp_path / "logs").mkdir()
    if lines is None:
        shutil.copy(REAL, tmp_path / "logs" / "agent.jsonl")
        shutil.copy(DATA / "claude-code-demo.launcher.log", tmp_path / "logs" / "launcher.log")
    else:
        (tmp_path / "logs" / "agent.jsonl").write_text("".join(x + "\n" for x in lines))
    return tmp_path


def _bash(tid: str, cmd: str) -> str:
    block = {"type": "tool_use", "id": tid, "name": "Bash", "input": {"command": cmd}}
    msg = {"id": f"m-{tid}", "content": [block]}
    return json.dumps({"type": "assistant", "message": msg, "timestamp": "2026-12-01T12:00:00Z"})


def _result(tid: str, text: str, *, is_error: bool = False) -> str:
    block = {"type": "tool_result", "tool_use_id": tid, "content": text, "is_error": is_error}
    return json.dumps({"type": "user", "message": {"content": [block]}})


# When the recorded task was created (the launcher log's clock times are of that day; the
# agent's stream is UTC). A fixed value: a checkout's file times say nothing about it.
REAL_CREATED_AT = datetime(2026, 12, 1, 12, 32, 4, tzinfo=UTC).timestamp()


def test_a_real_claude_code_transcript(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")  # the launcher log was written in UTC
    time.tzset()
    try:
        t = read_transcript(_task(tmp_path), created_at=REAL_CREATED_AT)
    finally:
        monkeypatch.undo()
        time.tzset()
    kinds = [e.kind for e in t.events]
    assert kinds[0] == "phase" and kinds[-1] == "phase"
    assert t.tools_run == {"Write": 2, "Edit": 1, "Bash": 1}
    assert t.last_test_command is not None
    assert t.last_test_command.command == "python3 -m unittest -v test_textutil"
    assert t.last_test_command.exit_code == 0
    bash = [e for e in t.events if e.tool == "Bash"]
    assert [e.kind for e in bash] == ["tool_call", "tool_result"]
    assert "Ran 2 tests" in bash[1].text and bash[1].exit_code == 0
    assert t.turns == 5 and t.skipped_lines == 0 and not t.truncated
    assert [e.seq for e in t.events] == list(range(len(t.events)))
    # "agent exited" comes after the agent's last event, though its time is whole seconds
    exited = next(i for i, e in enumerate(t.events) if e.text.startswith("agent exited"))
    assert all(e.source != "agent" for e in t.events[exited:])


def test_phases_of_one_second_keep_their_order_as_the_log_grows(tmp_path: Path) -> None:
    """The gateway, the workspace and the launch in the same second (a fast start): the
    phases before "running" stay before it, read by read, so the progress of
    ``agentbox run`` (which counts the launcher's events) shows each once. Before, the
    arrival of "running" moved the two earlier phases after it: one was shown twice and
    "running claude" never."""
    from agentbox.cli._logs import EventTail

    logs = tmp_path / "logs"
    logs.mkdir()
    day = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(day))
    phases = ["starting the gateway", "preparing the workspace", "running claude in sandbox x"]
    tail = EventTail(tmp_path, day - 1)
    shown: list[str] = []
    for n in range(1, len(phases) + 1):
        (logs / "launcher.log").write_text("".join(f"{stamp} {p}\n" for p in phases[:n]))
        shown += [line.plain for line in tail.new_lines()]
        order = [e.text for e in read_transcript(tmp_path, created_at=day - 1).events]
        assert order == phases[:n]
    assert [line.split(" ", 2)[-1].strip() for line in shown] == phases, shown


def test_failed_command_exit_code_and_output_capped_to_its_tail(tmp_path: Path) -> None:
    out = "Exit code 2\n" + "x" * 50_000 + "\nE   ModuleNotFoundError: No module named pytest"
    lines = [_bash("a", "cd /w && pytest -q"), _result("a", out, is_error=True),
             _bash("b", "ls"), _result("b", "README")]  # fmt: skip
    t = read_transcript(_task(tmp_path, lines), max_output=1000)
    assert t.last_test_command is not None and t.last_test_command.exit_code == 2
    res = next(e for e in t.events if e.kind == "tool_result")
    assert res.text.endswith("No module named pytest") and len(res.text) <= 1001
    assert res.output_chars == len(out) and res.is_error and res.line == 2
    assert t.tools_run == {"Bash": 2}


def test_a_test_command_that_never_returned(tmp_path: Path) -> None:
    t = read_transcript(_task(tmp_path, [_bash("a", "go test ./...")]))
    assert t.last_test_command is not None and t.last_test_command.exit_code is None


def test_heartbeats_and_unknown_events_are_not_events(tmp_path: Path) -> None:
    hb = json.dumps({"type": "tool_progress", "tool_use_id": "a", "elapsed": 3})
    lines = [hb, json.dumps({"type": "stream_event"}), "not json", "[1,2]", '{"type": 3}']
    t = read_transcript(_task(tmp_path, lines))
    assert [e for e in t.events if e.source == "agent"] == []
    assert t.skipped_lines == 2


def test_hostile_lines_never_crash(tmp_path: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    huge = json.dumps({"type": "assistant", "message": {"content": [{"type": "text",
                       "text": "y" * (MAX_LINE_BYTES + 10)}]}})  # fmt: skip
    odd = json.dumps({"type": "assistant", "message": {"content": [
        {"type": "tool_use", "name": {"x": 1}, "id": 5, "input": "str"},
        {"type": "text", "text": None}, 7, None]}})  # fmt: skip
    bad_time = json.dumps({"type": "user", "timestamp": "9" * 30, "message": {"content": [
        {"type": "tool_result", "tool_use_id": ["x"], "content": [{"text": 1}]}]}})  # fmt: skip
    t = read_transcript(_task(tmp_path, [deep, huge, odd, bad_time, "\x00\xff"]))
    assert t.skipped_lines == 3
    assert t.tools_run == {"?": 1}


def test_a_fifo_or_a_symlink_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    os.mkfifo(tmp_path / "logs" / "agent.jsonl")  # opening it must not block
    os.symlink("/etc/shadow", tmp_path / "logs" / "launcher.log")
    t = read_transcript(tmp_path)
    assert t.events == []


def test_no_files_at_all(tmp_path: Path) -> None:
    t = read_transcript(tmp_path)
    assert t.events == [] and t.last_test_command is None and t.tokens.total == 0


def test_gateway_refusals_and_metered_tokens(tmp_path: Path) -> None:
    from agentbox.gateway._usage import Usage, write_usage

    u = Usage(input=10, output=5, budget=20_000, weighted_total=20_000.0,
              refusals={"budget_exhausted": 1}, exhausted=True)  # fmt: skip
    write_usage(tmp_path / "usage.json", u)
    t = read_transcript(tmp_path)
    assert t.tokens.input == 10 and t.tokens.output == 5
    [ref] = [e for e in t.events if e.kind == "refusal"]
    assert "budget exhausted after 20,000 of 20,000 tokens" in ref.text


def test_looks_like_tests() -> None:
    for cmd in ["pytest -q", "python3 -m pytest", "cd x && npm test", "npm run test",
                "go test ./...", "cargo test", "make test", "make -j4 check",
                "python -m unittest discover", "uv run pytest tests/"]:  # fmt: skip
        assert is_test_command(cmd), cmd
    for cmd in ["ls", "cat pytest.ini", "echo testing", "git status", "npm install"]:
        assert not is_test_command(cmd), cmd


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(
                     st.sampled_from(["type", "message", "content", "id", "name", "input",
                                      "tool_use_id", "text", "is_error", "timestamp",
                                      "subtype", "result", "command"]), c, max_size=5),
                 max_leaves=30).map(lambda v: json.dumps(v).encode()),
), max_size=12))  # fmt: skip
def test_any_input_parses_without_raising(chunks: list[bytes]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "agent.jsonl"
        path.write_bytes(b"\n".join(chunks) + b"\n")
        p, _ = parse_agent_jsonl(path)
        for e in p.events:
            assert isinstance(e.text, str)


def test_rendered_lines_show_controls_as_escapes(tmp_path: Path) -> None:
    from rich.console import Console

    from agentbox.cli._logs import event_lines

    evil = "ok\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\u202eevil\r"
    lines = [_bash("a", f"echo {evil}"), _result("a", f"{evil}\n" * 30, is_error=True)]
    t = read_transcript(_task(tmp_path, lines))
    console = Console(file=None, force_terminal=False, width=200)
    for full in (False, True):
        for e in t.events:
            for line in event_lines(e, full=full):
                with console.capture() as cap:
                    console.print(line, soft_wrap=True)
                out = cap.get()
                assert "\x1b" not in out and "\u202e" not in out and "\r" not in out, out
    res = next(e for e in t.events if e.kind == "tool_result")
    shown = event_lines(res, full=False)
    assert len(shown) == 1 + 1 + 12  # head, "… earlier lines", the last 12


def test_agent_times_never_precede_the_launch(tmp_path: Path) -> None:
    """The sandbox's clock (the agent can set it; a restored guest's can lag) said the
    agent started an hour before its setup ran: ``logs`` showed "Claude Code started" at
    a time before the setup phase. Agent events are shown no earlier than the launch."""
    day = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    stamp = time.strftime("%H:%M:%S", time.localtime(day + 60))
    setup = time.strftime("%H:%M:%S", time.localtime(day))
    init = {"type": "system", "subtype": "init", "model": "m", "tools": []}
    early = {**json.loads(_bash("a", "ls")), "timestamp": "2026-12-01T11:00:00Z"}
    root = _task(tmp_path, [json.dumps(init), json.dumps(early)])
    (root / "logs" / "launcher.log").write_text(
        f"{setup} setting up the environment\n{stamp} running claude in sandbox x\n"
    )
    events = read_transcript(root, created_at=day - 1).events
    texts = [e.text for e in events]
    started = next(e for e in events if e.text.startswith("Claude Code started"))
    running = next(e for e in events if e.text.startswith("running claude"))
    assert texts.index("setting up the environment") < texts.index(started.text)
    assert started.time is not None and running.time is not None
    assert started.time >= running.time
