"""A gateway whose launcher died before it said ready keeps serving its task.

Since the sandbox starts beside its gateway (``spawn_gateway(wait=False)``), a
launcher killed in that window leaves a running sandbox whose gateway has nobody
reading its ready pipe. Writing "ready" then fails with EPIPE; the gateway must not
die of it (the agent would lose its model while the task is re-adopted). Real
gateway process; the launcher's end of the pipe is closed as its death would.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import httpx

from agentbox.config import Settings
from agentbox.gateway import spawn_gateway
from gateway_helpers import CHAT_SCRIPT, write_script

HI = {"max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


def test_a_gateway_whose_launcher_is_gone_before_ready_still_serves(
    tmp_path: Path, settings: Settings
) -> None:
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    handle = spawn_gateway(
        socket_path=tmp_path / "gw.sock",
        token_file=token_file,
        model="replay-demo",
        budget=50_000,
        usage_file=tmp_path / "usage.json",
        settings=settings,
        replay_script=write_script(tmp_path, CHAT_SCRIPT),
        log_file=tmp_path / "gw.log",
        wait=False,
    )
    try:
        fd, handle._ready_fd = handle._ready_fd, None  # the launcher dies: its end closes
        assert fd is not None, "wait=False must leave the ready pipe to the caller"
        os.close(fd)
        transport = httpx.HTTPTransport(uds=str(tmp_path / "gw.sock"))
        with httpx.Client(
            transport=transport, base_url="http://gw", timeout=60, headers={"x-api-key": token}
        ) as c:
            # Queued in the backlog until it serves; answered only if it did not die.
            reply = c.post("/v1/messages", json=HI)
        assert reply.status_code == 200, reply.text
        time.sleep(0.2)
        assert handle.alive(), (tmp_path / "gw.log").read_text(errors="replace")[-2000:]
    finally:
        handle.stop(grace=1.0)
