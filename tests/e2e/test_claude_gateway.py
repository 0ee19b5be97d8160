"""The real Claude Code binary through the gateway, playing replay scripts.

Claude Code talks to the gateway on TCP loopback (as it does inside a sandbox,
where a relay carries that port to the gateway's socket), authenticates with the
task token, and runs the script's tools (Write, Edit, Bash) on the host in a
temp dir. The gateway runs as its own process, started like the CLI does.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.gateway import DEMO_SCRIPT, Usage, read_usage
from gateway_helpers import write_script
from net_helpers import free_port, wait_port

pytestmark = pytest.mark.claude


BASH_HELLO = {"name": "Bash", "input": {"command": "echo hello-from-bash", "description": "Hi"}}
BASH_ONE = {"name": "Bash", "input": {"command": "echo one", "description": "Say one"}}


@dataclass
class Run:
    """What one Claude Code run left: its JSON result, its workspace, the gateway's usage."""

    out: dict[str, Any]
    returncode: int
    work: Path
    usage: Usage


@contextmanager
def _gateway(tmp_path: Path, script: Path, budget: int) -> Iterator[tuple[int, str, Path]]:
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    usage_file = tmp_path / "usage.json"
    port = free_port()
    argv = [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}"]
    argv += ["--token-file", str(token_file), "--model", "replay-demo", "--budget", str(budget)]
    argv += ["--usage-file", str(usage_file), "--upstream", f"replay:{script}"]
    with (tmp_path / "gateway.log").open("wb") as log:
        gw = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_port(port, gw)
            yield port, token, usage_file
        finally:
            _proc.kill_group(gw)  # type: ignore[arg-type]


def _claude(tmp_path: Path, script: Path, prompt: str, budget: int = 2_000_000) -> Run:
    work = tmp_path / "repo"
    home = tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "README.md").write_text("sample repo\n")
    with _gateway(tmp_path, script, budget) as (port, token, usage_file):
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": token,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        argv = [str(Settings().claude_binary), "-p", prompt, "--output-format", "json"]
        argv += ["--allowedTools", "Write Edit Read Bash"]
        res = _proc.run(argv, env=env, cwd=work, timeout=240, check=False)
    # The gateway wrote its final totals on SIGTERM.
    return Run(json.loads(res.stdout), res.returncode, work, read_usage(usage_file))


def test_claude_completes_demo_script_through_gateway(tmp_path: Path) -> None:
    run = _claude(
        tmp_path, DEMO_SCRIPT, "Add a slugify helper with a unit test, and run the tests."
    )
    out, work, usage = run.out, run.work, run.usage
    assert run.returncode == 0 and out["is_error"] is False, out
    assert out["num_turns"] == 5
    assert "passes (2 tests)" in out["result"]
    code = (work / "textutil.py").read_text()
    assert "def slugify" in code and "punctuation is dropped" in code  # Write, then Edit
    assert "class SlugifyTest" in (work / "test_textutil.py").read_text()
    # The tests really ran on the host (Bash tool): they left their bytecode.
    assert any((work / "__pycache__").glob("textutil*.pyc"))
    # Exactly the usage the script declares (see demo.yaml), and nothing refused.
    assert (usage.input, usage.output) == (3610, 420)
    assert (usage.cache_creation, usage.cache_read) == (9000, 38000)
    assert usage.weighted_total == pytest.approx(3610 + 420 + 9000 * 1.25 + 38000 * 0.1)
    assert usage.requests == 5 and usage.refusals == {} and usage.reserved == 0


def test_claude_retries_overloaded_and_rate_limited(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        {
            "name": "retry",
            "turns": [
                {
                    "text": "Checking.",
                    "errors": [{"status": 529}, {"status": 429, "retry_after": 1}],
                    "tool_use": [
                        {
                            "name": "Bash",
                            "input": {
                                "command": "echo hello-from-bash",
                                "description": "Say hello",
                            },
                        }
                    ],
                },
                {"match": "hello-from-bash", "text": "Done: it printed hello-from-bash."},
            ],
        },
    )
    run = _claude(tmp_path, script, "Say hello with bash.")
    assert run.returncode == 0 and run.out["is_error"] is False, run.out
    assert run.out["result"] == "Done: it printed hello-from-bash."
    u = run.usage
    assert u.upstream_errors == 2 and u.requests == 4 and u.refusals == {}


def test_claude_stopped_by_budget(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        {
            "name": "budget",
            "turns": [
                {
                    "text": "Checking.",
                    "tool_use": [
                        {"name": "Bash", "input": {"command": "echo one", "description": "Say one"}}
                    ],
                    "usage": {"input_tokens": 200_000, "output_tokens": 30},
                },
                {"text": "never reached"},
            ],
        },
    )
    # The second call's input estimate (~50 KB of prompt) does not fit the ~50k left,
    # with room for an answer: refused.
    run = _claude(tmp_path, script, "Say one.", budget=250_000)
    assert run.returncode != 0 and run.out["is_error"] is True
    assert "403" in run.out["result"] and "budget" in run.out["result"]
    u = run.usage
    assert u.refusals == {"over_budget": 1} and u.exhausted
    assert u.weighted_total == 200_030 <= u.budget


def test_claude_first_call_clamped_under_small_budget(tmp_path: Path) -> None:
    """Issue 13 item 3: Claude Code asks for a large max_tokens with a ~50 KB prompt, so
    its first call used to reserve more than a 100k budget and was refused (reported as
    "Failed to authenticate"). Now max_tokens is lowered to what is left and it goes."""
    script = write_script(tmp_path, {"name": "small", "turns": [{"text": "Done small."}]})
    run = _claude(tmp_path, script, "Say done.", budget=100_000)
    assert run.returncode == 0 and run.out["is_error"] is False, run.out
    assert run.out["result"] == "Done small."
    u = run.usage
    assert u.clamped >= 1 and u.refusals == {} and not u.exhausted
    assert u.weighted_total <= u.budget
