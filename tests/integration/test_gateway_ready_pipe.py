"""A gateway whose launcher died before it said ready keeps serving its task.

Since the sandbox starts beside its gateway (``spawn_gateway(wait=False)``), a
launcher killed in that window leaves a running sandbox whose gateway has nobody
reading its ready pipe. Writing "ready" then fails with EPIPE; the gateway must not
die of it (the agent would lose its model while the task is re-adopted). Real
gateway process; the launcher's end of the pipe is closed as its death would.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from agentbox.config import Settings
from gateway_helpers import spawn_replay_gateway

HI = {"max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


def test_a_gateway_whose_launcher_is_gone_before_ready_still_serves(
    tmp_path: Path, settings: Settings
) -> None:
    handle, token = spawn_replay_gateway(tmp_path, settings, wait=False)
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
