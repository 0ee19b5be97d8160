"""MCP ``delegate(…, continue_from=ID)`` against the real launcher, real podman and the real
Claude Code, with the official ``mcp`` SDK as the client (issue 13 §2).

The first task runs without waiting and its result is never asked for, so its branch
is not in the repo yet: ``continue_from`` must fetch it first (the launcher refuses a
continuation whose commit the repo lacks). The follow-up's replay model answers on
what it received: Claude Code must have resumed the first session (its first request
carries two assistant messages), the task text must name the previous-task file and
the file (read with Bash) must hold the first task's last message; its branch stacks
on the first.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client
from test_mcp_launcher import (
    Stack,
    _make_stack,
    _stop,
    _task_id,
    _text,
    _wait_path,
    ensure_socket_group,
)

from git_helpers import git

pytestmark = [pytest.mark.podman, pytest.mark.claude]

SECOND = """\
name: second
main: tools
side_reply: "Follow up"
turns:
  # Turns 0 and 1 answer only a fresh session: a resumed one carries the first task's two
  # assistant messages, so its first request is answered by turn 2.
  - text: "NOT-RESUMED"
  - text: "NOT-RESUMED"
  - branches:
      - match: "previous-task\\\\.md"
        text: "Reading what the previous task did."
        tool_use:
          - name: Bash
            input: {command: "cat {{cwd}}/.git/agentbox/previous-task.md", description: "read"}
      - text: "NO-FILE-NAMED"
  - branches:
      - match: "Added greet\\\\(\\\\) in greet\\\\.py"
        text: "Adding farewell() next to greet()."
        tool_use:
          - name: Write
            input:
              file_path: "{{cwd}}/farewell.py"
              content: "def farewell(name):\\n    return 'bye ' + name\\n"
      - text: "NO-PREVIOUS-TRANSCRIPT"
  - text: "SAW-PREVIOUS: resumed the session; farewell() added next to greet()."
"""


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    ensure_socket_group()
    base = Path(tempfile.mkdtemp(prefix="agentbox-mcpc-"))
    st = _make_stack(base)
    (base / "second.yaml").write_text(SECOND)
    with (base / "models.toml").open("a") as fh:
        fh.write('\n[models.second]\nkind = "replay"\nupstream = "second.yaml"\n')
    st.launcher = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"],
        env=st.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_path(st.data / "launcher.sock", st.launcher)
        yield st
    finally:
        _stop(st.launcher)
        shutil.rmtree(base, ignore_errors=True)


async def _continue(client: Client, stack: Stack) -> None:
    repo = stack.new_repo()
    async with client:
        first = _task_id(
            _text(
                await client.call_tool(
                    "delegate",
                    {"repo": str(repo), "task": "Add a greet function", "model": "quick"},
                )
            )
        )
        with anyio.fail_after(600):
            while True:
                state = _text(await client.call_tool("status", {"id": first}))
                if '"status": "done"' in state:
                    break
                assert '"status": "failed"' not in state, state
                await anyio.sleep(1)
        # Not fetched yet: only `result` (not called) would have fetched it.
        assert f"agentbox/{first}" not in git(repo, "for-each-ref", "--format=%(refname:short)")

        bad = await client.call_tool(
            "delegate", {"repo": str(repo), "task": "Go on", "continue_from": "no-such-task"}
        )
        assert bad.is_error, _text(bad)

        res = await client.call_tool(
            "delegate",
            {"repo": str(repo), "task": "Add farewell", "model": "second", "wait": True,
             "continue_from": first},
        )  # fmt: skip
        text = _text(res)
        assert not res.is_error, text
        assert "SAW-PREVIOUS" in text and "+def farewell(name):" in text, text
        m = re.search(r"task (\S+): done", text)
        assert m, text
        second = m.group(1)
    assert git(repo, "rev-parse", f"agentbox/{second}~1") == git(
        repo, "rev-parse", f"agentbox/{first}"
    )
    names = git(repo, "diff", "--name-only", f"agentbox/{first}", f"agentbox/{second}")
    assert names.split() == ["farewell.py"], names


def test_delegate_continue_from_over_stdio(stack: Stack) -> None:
    anyio.run(_continue, stack.stdio_client(), stack)
