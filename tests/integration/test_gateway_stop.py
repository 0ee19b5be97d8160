"""A gateway's stop: prompt, and still graceful (issue 15 item 2).

The launcher waits for a task's gateway to exit before it collects the task; uvicorn
noticed a stop on a 0.1 s tick, paused 0.1 s and polled its connections every 0.1 s,
and the interpreter's teardown took 0.2-0.3 s more (0.3-0.5 s per task). What the
stop waits for is unchanged: a request in flight is answered in full and counted in
the usage file.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from agentbox.config import Settings
from agentbox.gateway import read_usage
from agentbox.gateway._run import build_gateway
from gateway_helpers import (
    CHAT_SCRIPT,
    ThreadServers,
    replay_entry,
    spawn_replay_gateway,
    wait_usage,
    write_script,
)


def test_a_stop_pauses_for_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the stop to the end, no 0.1 s sleep of uvicorn's (its tick, its pause, its
    polls): every sleep the servers take once stopping is a few milliseconds."""
    script = write_script(tmp_path, CHAT_SCRIPT)
    group, _, _ = build_gateway(
        listen=f"unix:{tmp_path / 'gw.sock'}",
        token=secrets.token_urlsafe(24),
        entry=replay_entry(),
        budget=1000,
        upstream=f"replay:{script}",
        usage_file=tmp_path / "usage.json",
    )
    servers = ThreadServers(group)
    stopping = threading.Event()
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        if stopping.is_set():
            slept.append(delay)
        return await real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    stopping.set()
    servers.stop()
    assert not servers.thread.is_alive() and servers.error is None
    assert [d for d in slept if d >= 0.05] == [], slept


def test_a_stop_answers_the_request_in_flight_and_counts_it(
    tmp_path: Path, settings: Settings
) -> None:
    script = dict(CHAT_SCRIPT, turns=[dict(CHAT_SCRIPT["turns"][0], delay=1.0)])
    sock, usage = tmp_path / "gw.sock", tmp_path / "usage.json"
    handle, token = spawn_replay_gateway(tmp_path, settings, script)
    got: dict[str, Any] = {}

    def ask() -> None:
        with httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock))) as http:
            client = anthropic.Anthropic(
                api_key=token, base_url="http://gateway", max_retries=0, http_client=http
            )
            try:
                msg = client.messages.create(
                    model="x", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
                )
                got["text"] = msg.content[0].text  # type: ignore[union-attr]
            except Exception as exc:  # the assertion below says what it was
                got["error"] = exc

    asker = threading.Thread(target=ask)
    try:
        asker.start()
        wait_usage(usage, lambda u: u.requests >= 1)  # it is in the gateway now
        code = handle.stop(grace=10.0)
    finally:
        handle.stop()
        asker.join(30)
    assert got.get("text") == "Hello from the replay model.", got
    assert code == 0
    u = read_usage(usage)
    assert (u.requests, u.input, u.output) == (1, 11, 7)
