"""The request ledger written by a real, confined gateway process (spawn_gateway, dropped
to another uid, its state in ``usage.json.d/``): one record per model request, streamed or
not, keyed by the upstream's message id, summing to the usage file's totals."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import anthropic
import httpx2
import pytest

from agentbox.config import Settings
from agentbox.gateway import read_requests
from gateway_helpers import spawn_replay_gateway, wait_usage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="drops to another uid: needs root")


def test_ledger_of_a_confined_gateway_sums_to_usage(tmp_path: Path, settings: Settings) -> None:
    task = Path(tempfile.mkdtemp(prefix="agentbox-gw-ledger-", dir="/tmp"))
    usage = task / "usage.json"
    sock = tmp_path / "gw.sock"
    handle, token = spawn_replay_gateway(
        tmp_path, settings, usage_file=usage, run_as=(65534, 65534)
    )
    try:
        assert usage.is_symlink()  # the confined layout: the ledger is in usage.json.d/
        client = anthropic.Anthropic(
            api_key=token,
            base_url="http://gateway",
            max_retries=0,
            http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock))),
        )
        with client:  # its connection closed here, not left to the garbage collector
            first = client.messages.create(
                model="x", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
            )
            with client.messages.stream(
                model="x", max_tokens=30, messages=[{"role": "user", "content": "again"}]
            ) as stream:
                second = stream.get_final_message()
        u = wait_usage(usage, lambda u: u.requests == 2 and u.reserved == 0)
    finally:
        handle.stop()
    try:
        recs = read_requests(usage)
        assert [r.message_id for r in recs] == [first.id, second.id]
        assert [r.stop_reason for r in recs] == [first.stop_reason, second.stop_reason]
        assert all(r.status == 200 and r.complete for r in recs)
        assert (recs[0].input, recs[0].output) == (
            first.usage.input_tokens, first.usage.output_tokens)  # fmt: skip
        assert (recs[1].input, recs[1].output) == (
            second.usage.input_tokens, second.usage.output_tokens)  # fmt: skip
        for kind in ("input", "output", "cache_creation", "cache_read"):
            assert sum(getattr(r, kind) for r in recs) == getattr(u, kind), kind
        ledger = task / "usage.json.d" / "requests.jsonl"
        assert ledger.stat().st_size > 0 and ledger.stat().st_mode & 0o022 == 0
    finally:
        shutil.rmtree(task, ignore_errors=True)
