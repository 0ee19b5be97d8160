"""The usage file's writes coalesce under load (issue 15 item 4: the gateway's own CPU).

Each write is a rename over the old file, ~0.3 ms of its writer thread's CPU; at one
write per 10 ms that was 10-18 % of a busy gateway's CPU. A real gateway (in-process,
real sockets, real replay model) answers a burst of requests; the writes it made are
counted by wrapping the real writer (it still writes), and bounded by the burst's own
wall time, so a slow machine allows proportionally more writes and no timing is
asserted.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.gateway import _app
from gateway_helpers import running_gateway

BURST = 40


def _body() -> dict[str, Any]:
    return {
        "model": "test-model",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_usage_writes_coalesce_to_one_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[float] = []
    lock = threading.Lock()
    real = _app.write_bytes_atomic

    def counted(*args: Any, **kw: Any) -> None:
        with lock:
            writes.append(time.monotonic())
        real(*args, **kw)

    monkeypatch.setattr(_app, "write_bytes_atomic", counted)
    with running_gateway(tmp_path) as gw, httpx.Client(timeout=30) as c:
        r = c.post(f"{gw.url}/v1/messages", headers=gw.auth(), json=_body())
        assert r.status_code == 200, r.text
        first = gw.usage()  # settled: the warm-up's write is done
        writes.clear()
        t0 = time.monotonic()
        for _ in range(BURST):
            r = c.post(f"{gw.url}/v1/messages", headers=gw.auth(), json=_body())
            assert r.status_code == 200, r.text
        elapsed = time.monotonic() - t0
        final = gw.usage()
    # Every request is in the file in the end (the last change is never dropped) ...
    assert final.requests == first.requests + BURST
    assert final.output > first.output
    # ... with at most ~10 writes a second while the burst ran, plus the first one and
    # the one after it (before: a write per request whenever requests were spaced more
    # than one write apart, as here).
    allowed = elapsed / 0.1 + 2
    assert 1 <= len(writes) <= allowed, (len(writes), elapsed)
