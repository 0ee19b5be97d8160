"""The transcript end to end (issue 13.1): a real Claude Code in a real podman sandbox runs
two commands through its Bash tool (a print and a failing test run); then

- ``agentbox logs ID`` shows each command with its output and exit code (it printed
  "agent tool result" with no content before), ``--json`` gives the typed events;
- the report's ``tools_run`` and ``last_test_command`` (with exit code 1) are set, and
  ``agentbox show`` prints the tests line next to the status;
- over MCP (the official SDK client, the server dropped to another uid): ``result`` has
  "tests: FAILED (exit 1 …" in its head and the transcript's tail, framed as untrusted;
  ``transcript(id, since)`` pages through the events.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

MCP_UID = 64124
MARKER = "marker-42"  # only the command's output holds it: the script says 6*7

SCRIPT = """\
name: cmd
main: tools
side_reply: "Run"
turns:
  - text: "Checking the interpreter."
    tool_use:
      - name: Bash
        input: {command: "python3 -c \\"print('marker-' + str(6*7))\\"", description: "Print"}
  - text: "Running the tests."
    tool_use:
      - name: Bash
        input: {command: "python3 -m unittest test_no_such_module", description: "Run tests"}
  - text: "The tests fail: there is no such test module."
"""


@dataclass
class Stack:
    base: Path
    repo: Path
    env: dict[str, str]
    task_id: str = ""
    mcp_text: str = ""


def _agentbox(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args], env=stack.env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip


def _text(res: object) -> str:
    return " ".join(getattr(c, "text", "") for c in getattr(res, "content", []))


def _client(stack: Stack) -> Client:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentbox", "mcp", "--user", str(MCP_UID)],
        env=stack.env,
    )
    return Client(params, read_timeout_seconds=600)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    import grp

    try:
        grp.getgrnam("agentbox")
    except KeyError:
        subprocess.run(["groupadd", "-f", "--system", "agentbox"], check=True)
    base = Path(tempfile.mkdtemp(prefix="agentbox-transcript-"))
    base.chmod(0o755)
    repos = base / "repos"
    repos.mkdir()
    repo = repos / "proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("hello\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    subprocess.run(["chown", "-R", "-h", f"{MCP_UID}:{MCP_UID}", str(repos)], check=True)
    (base / "cmd.yaml").write_text(SCRIPT)
    (base / "models.toml").write_text('[models.cmd]\nkind = "replay"\nupstream = "cmd.yaml"\n')
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(repos),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "COLUMNS": "200",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    st = Stack(base, repo, env)
    try:
        sock = base / "data" / "launcher.sock"
        for _ in range(600):
            if sock.exists() or launcher.poll() is not None:
                break
            anyio.run(anyio.sleep, 0.1)
        assert sock.exists(), launcher.stderr.read().decode() if launcher.stderr else ""
        anyio.run(_delegate, st)
        yield st
    finally:
        launcher.terminate()
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
        if launcher.stderr is not None:
            launcher.stderr.close()
        shutil.rmtree(base, ignore_errors=True)


async def _delegate(st: Stack) -> None:
    async with _client(st) as client:
        res = await client.call_tool(
            "delegate",
            {"repo": str(st.repo), "task": "Run the tests", "model": "cmd", "wait": True},
        )
        st.mcp_text = _text(res)
        assert not res.is_error, st.mcp_text
    m = re.search(r"task (\S+): done", st.mcp_text)
    assert m, st.mcp_text
    st.task_id = m.group(1)


def test_logs_show_each_command_with_its_output(stack: Stack) -> None:
    r = _agentbox(stack, "logs", stack.task_id)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "$ python3 -c" in out and MARKER in out, out
    assert "$ python3 -m unittest test_no_such_module" in out, out
    assert "exit 1" in out and "test_no_such_module" in out.split("exit 1", 1)[1], out
    assert "tool_progress" not in out and "running claude" in out, out
    assert re.search(r"^\d\d:\d\d:\d\d ", out, re.M), out  # every event has its time
    assert "tokens (metered by the gateway)" in out


def test_logs_json_and_the_report(stack: Stack) -> None:
    doc = json.loads(_agentbox(stack, "logs", stack.task_id, "--json").stdout)
    results = [e for e in doc["events"] if e["kind"] == "tool_result"]
    assert [e["exit_code"] for e in results] == [0, 1], results
    assert MARKER in results[0]["text"]
    assert doc["tools_run"] == {"Bash": 2}
    show = json.loads(_agentbox(stack, "show", stack.task_id, "--json").stdout)
    rep = show["result"]["report"]
    assert rep["tools_run"] == {"Bash": 2}
    assert rep["last_test_command"] == {
        "command": "python3 -m unittest test_no_such_module",
        "exit_code": 1,
    }
    text = _agentbox(stack, "show", stack.task_id, "--no-diff").stdout
    assert re.search(r"tests\s+FAILED \(exit 1\): python3 -m unittest", text), text


def test_mcp_result_has_tests_and_the_framed_transcript_tail(stack: Stack) -> None:
    text = stack.mcp_text
    head = text.partition("UNTRUSTED DATA")[0]
    assert "tests: FAILED (exit 1" in head, text
    assert MARKER not in head  # the agent's output only inside a framed block
    assert f"transcript of task {stack.task_id}" in text, text
    tail = text.split(f"transcript of task {stack.task_id}", 1)[1]
    begin = re.search(r"^<<<agent-data ([0-9a-f]{24})>>>$", tail, re.M)
    assert begin, tail
    inner = tail[begin.end() :].split(f"\n<<<end agent-data {begin.group(1)}>>>")[0]
    assert MARKER in inner and "$ python3 -m unittest" in inner, tail


async def _page(st: Stack) -> None:
    async with _client(st) as client:
        first = _text(await client.call_tool("transcript", {"id": st.task_id}))
        m = re.search(r"events 0\.\.(\d+) of (\d+)", first)
        assert m, first
        total = int(m.group(2))
        assert "[0] " in first and MARKER in first
        end = _text(await client.call_tool("transcript", {"id": st.task_id, "since": total}))
        assert "no more events yet" in end and MARKER not in end, end
        last = _text(await client.call_tool("transcript", {"id": st.task_id, "since": -3}))
        assert f"events {total - 3}..{total - 1} of {total}" in last, last
        bad = await client.call_tool("transcript", {"id": "../etc"})
        assert bad.is_error


def test_mcp_transcript_pages(stack: Stack) -> None:
    anyio.run(_page, stack)


def test_run_piped_prints_the_id_at_once_then_one_line_per_event(stack: Stack) -> None:
    data = stack.base / "data-run"  # its own launcher (in-process), not the served one
    data.mkdir()
    env = {**stack.env, "AGENTBOX_DATA_DIR": str(data)}
    argv = [sys.executable, "-m", "agentbox", "run", "--repo", str(stack.repo), "--model", "cmd",
            "--no-publish", "Run the tests"]  # fmt: skip
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    lines = r.stderr.splitlines()
    # The model is a replay entry: one note says so, before anything else.
    notes = [ln for ln in lines if ln.startswith("note: model ")]
    assert len(notes) == 1 and "is scripted" in notes[0], r.stderr
    lines = [ln for ln in lines if ln not in notes]
    assert lines and re.match(r"task t-[0-9a-f]+ queued", lines[0]), r.stderr
    assert any("$ python3 -c" in ln for ln in lines), r.stderr
    assert MARKER in r.stderr and "running claude" in r.stderr, r.stderr
    assert all(re.match(r"\d\d:\d\d:\d\d |\s", ln) for ln in lines[1:]), r.stderr
    assert re.search(r"tests\s+FAILED \(exit 1\): python3 -m unittest", r.stdout), r.stdout


def test_per_turn_tokens_come_from_the_gateway_and_sum_to_its_totals(stack: Stack) -> None:
    """Each agent turn carries the tokens the gateway metered for its message id (its
    request ledger), and the ledger's records sum to the usage file's totals."""
    doc = json.loads(_agentbox(stack, "logs", stack.task_id, "--json").stdout)
    turns = doc["turn_tokens"]
    assert turns and all(t["status"] == 200 and t["complete"] for t in turns), turns
    for kind in ("input", "output", "cache_creation", "cache_read"):
        assert sum(t["tokens"][kind] for t in turns) == doc["tokens"][kind], (kind, turns)
    agent_ids = {e["message_id"] for e in doc["events"] if e["kind"] in ("text", "tool_call")}
    by_id = {t["message_id"]: t for t in turns if t["in_transcript"]}
    assert agent_ids and agent_ids == set(by_id), (agent_ids, turns)  # every turn joined
    carried = [e for e in doc["events"] if e.get("tokens")]
    assert len(carried) == len(agent_ids)  # once per turn, on its first event
    for e in carried:
        assert e["tokens"] == by_id[e["message_id"]]["tokens"]
        assert e["tokens"]["output"] > 0
    out = _agentbox(stack, "logs", stack.task_id).stdout
    assert len(re.findall(r"turn\s+tokens \(metered by the gateway\): in ", out)) == len(carried)
