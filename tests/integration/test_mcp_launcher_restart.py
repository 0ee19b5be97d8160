"""The MCP server rides through a launcher restart (issue 19): no restart of its own.

The MCP server runs as root and drops to ``MCP_UID`` (it can no longer traverse the
data dir); it reaches the launcher through the socket's directory, pinned before the
drop. The launcher is killed (SIGKILL) and a new one started, which binds a new
socket: the same MCP session's next call reaches it. Before the fix the server held
the old socket's inode and every call failed until the MCP server was restarted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from test_mcp_launcher import MCP_UID, _make_stack, _stop, _text, _wait_path, ensure_socket_group

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]


def _serve(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def test_the_mcp_server_reaches_a_restarted_launcher() -> None:
    ensure_socket_group()
    base = Path(tempfile.mkdtemp(prefix="agentbox-mcpr-"))
    st = _make_stack(base)
    launcher = _serve(st.env)
    try:
        _wait_path(st.data / "launcher.sock", launcher)
        client = Client(
            StdioServerParameters(
                command=sys.executable,
                args=["-m", "agentbox", "mcp", "--user", str(MCP_UID)],
                env=st.env,
            ),
            read_timeout_seconds=120,
        )

        async def session() -> None:
            nonlocal launcher
            async with client:
                before = await client.call_tool("list_tasks", {})
                assert not before.is_error, _text(before)
                os.kill(launcher.pid, signal.SIGKILL)
                _stop(launcher)  # reaps it and closes its pipe
                launcher = _serve(st.env)
                after = await client.call_tool("list_tasks", {})
                assert not after.is_error, _text(after)

        anyio.run(session)
    finally:
        _stop(launcher)
        shutil.rmtree(base, ignore_errors=True)
