"""The launcher's Prometheus metrics and a task's OpenTelemetry trace, with the real Claude
Code on podman: ``agentbox launcher serve --metrics 127.0.0.1:0`` scraped over HTTP while a
task runs (it shows running) and after (done, with its phase durations and tokens); the
task's trace reaches a real OTLP/HTTP receiver (protobuf, decoded with the
``opentelemetry-proto`` messages) with a span per phase and per model request."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentbox.gateway import read_requests
from git_helpers import git
from otlp_receiver import Received, attrs, otlp_receiver
from task_cleanup import sweep

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

NAPPER = """\
name: napper
turns:
  - text: "Napping, then writing."
    tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(6)'; echo woke"
          description: nap
  - text: "Writing the file."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/nap.txt", content: "rested\\n"}
  - text: "Done."
"""


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "node"))
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[Path, dict[str, str], str, Received]]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-metrics-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    (base / "napper.yaml").write_text(NAPPER)
    (base / "models.toml").write_text(
        'default = "napper"\n[models.napper]\nkind = "replay"\nupstream = "napper.yaml"\n'
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    with otlp_receiver() as (endpoint, received):
        served = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "AGENTBOX_POOL_SIZE": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve", "--metrics", "127.0.0.1:0"],
            env=served, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            url = ""
            assert proc.stderr is not None
            for line in proc.stderr:
                m = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", line)
                if m:
                    url = m.group(1)
                    break
            assert url, "the launcher never said where its metrics are"
            yield base, env, url, received
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=120)
            sweep(base, env)
            shutil.rmtree(base, ignore_errors=True)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_metrics_while_running_and_after_and_the_trace(
    world: tuple[Path, dict[str, str], str, Received],
) -> None:
    base, env, url, received = world
    before = _samples(httpx.get(url, timeout=10).text)
    assert before[("agentbox_launcher_starts_total", ())] == 1
    assert before[("agentbox_pool_claims_total", ())] == 0
    end = time.monotonic() + 120  # the launcher's warm pool (size 1) fills
    while before.get(("agentbox_pool_ready", ())) != 1 and time.monotonic() < end:
        time.sleep(0.5)
        before = _samples(httpx.get(url, timeout=10).text)
    assert before[("agentbox_pool_ready", ())] == 1, before
    repo = base / "repos" / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("hi\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
    r = _cli(env, "run", "--detach", "--json", "--repo", str(repo), "Nap, then write nap.txt")
    assert r.returncode == 0, (r.stdout, r.stderr)
    task_id = json.loads(r.stdout)["id"]

    # While the agent naps: the task shows running on podman, a gateway and a sandbox live.
    running = ("agentbox_tasks", (("backend", "podman"), ("status", "running")))
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    end = time.monotonic() + 180
    while time.monotonic() < end:
        seen = _samples(httpx.get(url, timeout=10).text)
        if seen.get(running) == 1 and seen.get(("agentbox_sandboxes_live", ())) == 1:
            break
        time.sleep(0.5)
    assert seen.get(running) == 1, seen
    assert seen[("agentbox_gateways_live", ())] == 1

    w = _cli(env, "wait", task_id, "--json", "--timeout", "300")
    assert w.returncode == 0, (w.stdout, w.stderr)
    after = _samples(httpx.get(url, timeout=10).text)
    assert after[("agentbox_tasks", (("backend", "podman"), ("status", "done")))] == 1
    assert after.get(running, 0) == 0
    assert after[("agentbox_sandboxes_live", ())] == 0
    # one finished task in every phase it went through; the agent's nap is in its duration
    for phase in ("queue", "start", "agent", "collect"):
        key = ("agentbox_phase_duration_seconds_count", (("phase", phase),))
        assert after[key] == 1, (phase, after)
    agent_s = after[("agentbox_phase_duration_seconds_sum", (("phase", "agent"),))]
    assert agent_s >= 6, agent_s
    assert after[("agentbox_phase_duration_seconds_count", (("phase", "setup"),))] == 0
    assert after[("agentbox_task_duration_seconds_count", ())] == 1
    assert after[("agentbox_tokens_total", (("kind", "input"), ("model", "napper")))] > 0
    assert after[("agentbox_egress_requests_total", (("verdict", "allowed"),))] == 0
    assert after[("agentbox_pool_claims_total", ())] == 1  # the task took the pooled sandbox

    # The trace: sent once the task ended (the launcher exports before `wait` returns
    # only if it was quick; give it the exporter's time).
    assert received.got.wait(30), "no trace reached the receiver"
    assert received.bad == []
    (task,) = received.by_name("agentbox.task")
    a = attrs(task)
    assert a["agentbox.task.status"] == "done" and a["agentbox.model"] == "napper"
    assert a["agentbox.backend"] == "podman" and a["agentbox.tokens.input"] > 0
    phases = {s.name: s for s in received.spans if s.parent_span_id == task.span_id}
    assert set(phases) == {"agentbox.queue", "agentbox.start", "agentbox.agent", "agentbox.collect"}
    agent = phases["agentbox.agent"]
    assert agent.end_time_unix_nano - agent.start_time_unix_nano >= 6e9
    assert all(s.trace_id == task.trace_id for s in received.spans)
    requests = received.by_name("agentbox.model_request")
    ledger = read_requests(base / "data" / "tasks" / task_id / "usage.json")
    assert len(requests) == len(ledger) >= 3
    assert all(s.parent_span_id == agent.span_id for s in requests)
    for s in requests:
        assert attrs(s)["gen_ai.response.model"] == "napper"
        assert s.start_time_unix_nano <= s.end_time_unix_nano
    # nothing the agent wrote or the task text is an attribute
    assert "Nap, then write" not in str([attrs(s) for s in received.spans])
