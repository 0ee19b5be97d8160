"""A best-of-N group's shared budget when one attempt's gateway is killed mid-request.

Real gateway processes (``spawn_gateway``, dropped to the gateway uid as a task's),
sharing one group budget file as the launcher links it (``--budget-split shared``), in
front of an upstream that takes requests and never answers. A gateway killed with a
request in flight leaves its hold in the file; the next live gateway of the group to
take the file's lock turns that hold into what the dead one charged (the worst case,
as its own ledger settles a request whose end it did not see), so it no longer counts
as in flight. A live gateway's hold is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.config import Settings
from agentbox.gateway import GROUP_BUDGET_FILE, GatewayHandle, gateway_identity, spawn_gateway

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the gateway drops from root only")

BUDGET = 60_000


class StalledUpstream:
    """A loopback HTTP server that reads each request and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
        self.thread.join(10)


@pytest.fixture
def upstream() -> Iterator[StalledUpstream]:
    up = StalledUpstream()
    try:
        yield up
    finally:
        up.close()


def _gateway(settings: Settings, root: Path, name: str, group_file: Path) -> GatewayHandle:
    """An attempt's gateway laid out as the launcher lays it out, the group's file linked
    into its state directory before it starts (launcher._groupbudget.link_for_gateway)."""
    d = root / name
    d.mkdir(mode=0o755)
    usage = d / "usage.json"
    state = usage.with_name(usage.name + ".d")
    state.mkdir(mode=0o700)
    os.link(group_file, state / GROUP_BUDGET_FILE)
    token = d / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    return spawn_gateway(
        socket_path=d / "gw.sock",
        token_file=token,
        model="stall",
        budget=BUDGET,
        usage_file=usage,
        settings=settings,
        log_file=d / "gw.log",
        run_as=gateway_identity(settings),
        exit_at=time.time() + 300,
    )


def _ask_in_background(gw: GatewayHandle, token: str, threads: list[threading.Thread]) -> None:
    """One request the upstream never answers (its thread ends when the gateway or the
    upstream goes)."""
    body = {"model": "x", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}

    def ask() -> None:
        transport = httpx.HTTPTransport(uds=str(gw.socket_path))
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.Client(transport=transport, base_url="http://gw", timeout=120) as c,
        ):
            c.post("/v1/messages", json=body,
                   headers={"x-api-key": token, "anthropic-version": "2023-06-01"})  # fmt: skip

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    threads.append(t)


def _doc(group_file: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(group_file.read_text())
    return doc


def _slot(group_file: Path, pid: int) -> list[float] | None:
    doc = _doc(group_file)
    for key, who in doc.get("holders", {}).items():
        if who[0] == pid:
            slot: list[float] = doc["slots"][key]
            return slot
    return None


def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60  # a loaded host: generous, never a tight sleep
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_a_killed_gateways_hold_is_reclaimed_by_the_group(
    settings: Settings, tmp_path: Path, upstream: StalledUpstream
) -> None:
    models = tmp_path / "models.toml"
    models.write_text(
        f'[models.stall]\nkind = "compatible"\nupstream = "http://127.0.0.1:{upstream.port}"\n'
    )
    s = settings.model_copy(update={"models_file": models})
    root = tmp_path / "attempts"
    root.mkdir(mode=0o755)
    group_file = tmp_path / "budget.json"
    group_file.write_text(json.dumps({"budget": BUDGET, "budget_usd": None, "slots": {}}))
    group_file.chmod(0o600)
    threads: list[threading.Thread] = []
    with _gateway(s, root, "a", group_file) as a, _gateway(s, root, "b", group_file) as b:
        tokens = {n: (root / n / "token").read_text() for n in ("a", "b")}
        _ask_in_background(a, tokens["a"], threads)

        def a_holds() -> bool:
            slot = _slot(group_file, a.pid)
            return slot is not None and slot[1] > 0

        _until("a's request held budget", a_holds)
        a_slot = _slot(group_file, a.pid)
        assert a_slot is not None
        one = a_slot[1]  # what one such request holds (its worst case)
        # A live holder's hold is left alone: b's request sees a's as in flight.
        _ask_in_background(b, tokens["b"], threads)
        _until("b's request held budget", lambda: (_slot(group_file, b.pid) or [0, 0])[1] > 0)
        assert _slot(group_file, a.pid) == a_slot

        os.kill(a.pid, signal.SIGKILL)  # mid-request: nothing of a settles its hold
        a._proc.wait(30)
        assert _slot(group_file, a.pid) == a_slot  # nobody has looked yet

        _ask_in_background(b, tokens["b"], threads)
        _until("b's second request held budget",
               lambda: (_slot(group_file, b.pid) or [0, 0])[1] >= 2 * one)  # fmt: skip
        doc = _doc(group_file)
        slots = doc["slots"]
        b_slot = _slot(group_file, b.pid)
        assert b_slot is not None and b_slot[1] == pytest.approx(2 * one)
        (a_key,) = [k for k in slots if slots[k] != b_slot]
        # a's hold is now what it charged (the worst case of its request), not held.
        assert slots[a_key][1] == 0.0
        assert slots[a_key][0] == pytest.approx(a_slot[0] + one)
        assert a_key not in doc["holders"]
        total = sum(v[0] + v[1] for v in slots.values())
        assert total == pytest.approx(3 * one) and total <= BUDGET
    for t in threads:
        t.join(30)
