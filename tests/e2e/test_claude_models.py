"""Issue 27 with the real Claude Code: the model it is told to use, thinking, a refusal.

* In a real sandbox (podman), the agent's own ``env`` shows the task's model id in every
  variable Claude Code resolves its models from, and the gateway's request log shows the
  id Claude Code asked for: the same one.
* On the host, through the gateway process: a script whose turns think (thinking blocks
  with signatures, streamed as ``thinking_delta`` then ``signature_delta``) is played to
  the end, the thinking metered as output exactly; a turn that ends in ``refusal`` is
  taken by Claude Code (which asks once more), and the gateway's request log records it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.gateway import read_requests, read_usage
from env_helpers import EnvLab
from gateway_helpers import write_script
from git_helpers import git
from net_helpers import free_port, wait_port

pytestmark = pytest.mark.claude

MODEL_VARS = (
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)

ENV_SCRIPT = """\
name: model-env
turns:
  - text: "Which model am I told to use?"
    tool_use:
      - name: Bash
        input:
          command: >-
            env | grep -E '^(ANTHROPIC_[A-Z_]*MODEL|CLAUDE_CODE_SUBAGENT_MODEL)=' | sort
            > model-env.txt; cat model-env.txt
          description: "Show the model variables"
  - text: "Done: wrote model-env.txt."
"""


@pytest.mark.podman
def test_the_agent_sees_the_tasks_model_and_asks_for_it(
    env_lab: Callable[..., EnvLab],
) -> None:
    lab = env_lab("models-env", ENV_SCRIPT)
    repo = lab.repo("models-env", {"README.md": "sample\n"})
    run = lab.run("models-env", repo, deadline=300.0)
    assert run.info.status == "done", run.info.error
    seen = git(repo, "show", f"{run.result.branch}:model-env.txt").splitlines()
    # A replay entry's id is its name: what Claude Code is told, and what it asks for.
    assert seen == [f"{name}={lab.model}" for name in MODEL_VARS]
    records = read_requests(run.task_dir / "usage.json")
    assert records and {r.asked for r in records} == {lab.model}
    started = [e.text for e in lab.launcher.transcript(run.info.id, limit=50).events
               if e.text.startswith("Claude Code started")]  # fmt: skip
    assert started and started[0].startswith(f"Claude Code started (model {lab.model}")
    assert "asked for" not in started[0]  # it asked for the task's model


def _claude(tmp_path: Path, script: dict[str, Any], prompt: str) -> tuple[dict[str, Any], Path]:
    """Real Claude Code on the host through a gateway process playing ``script``."""
    path = write_script(tmp_path, script, "script.yaml")
    token = secrets.token_urlsafe(24)
    (tmp_path / "token").write_text(token)
    (tmp_path / "token").chmod(0o600)
    usage = tmp_path / "usage.json"
    port = free_port()
    argv = [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}",
            "--token-file", str(tmp_path / "token"), "--model", "replay-demo",
            "--usage-file", str(usage), "--upstream", f"replay:{path}"]  # fmt: skip
    work, home = tmp_path / "repo", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    with (tmp_path / "gateway.log").open("wb") as log:
        gw = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_port(port, gw)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                   "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": token,
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip
            cmd = [str(Settings().claude_binary), "-p", prompt, "--output-format", "json",
                   "--allowedTools", "Bash"]  # fmt: skip
            res = _proc.run(cmd, env=env, cwd=work, timeout=240, check=False)
        finally:
            _proc.kill_group(gw)  # type: ignore[arg-type]
    return json.loads(res.stdout), usage


THOUGHT = "The user wants a greeting printed; a single echo does it. " * 4


def test_claude_plays_thinking_turns_and_the_gateway_meters_them(tmp_path: Path) -> None:
    script = {"name": "think", "turns": [
        {"thinking": THOUGHT, "text": "Printing it.",
         "tool_use": [{"name": "Bash", "input": {"command": "echo thought-through",
                                                  "description": "Greet"}}],
         "usage": {"input_tokens": 1200, "output_tokens": 333}},
        {"thinking": "It printed; done.", "text": "Done: it printed thought-through.",
         "usage": {"input_tokens": 1300, "output_tokens": 44}},
    ]}  # fmt: skip
    out, usage_file = _claude(tmp_path, script, "Print a greeting.")
    assert out["is_error"] is False, out
    assert out["result"] == "Done: it printed thought-through."
    usage = read_usage(usage_file)
    # Thinking is output, metered exactly as the upstream reported it.
    assert (usage.input, usage.output) == (2500, 377)
    records = read_requests(usage_file)
    assert [r.stop_reason for r in records] == ["tool_use", "end_turn"]


def test_claude_stops_on_a_refusal_and_the_gateway_records_it(tmp_path: Path) -> None:
    script = {"name": "refuse", "turns": [
        {"text": "I can't help with that request.", "stop_reason": "refusal",
         "usage": {"input_tokens": 900, "output_tokens": 12}},
        {"text": "Understood; nothing was done.",
         "usage": {"input_tokens": 950, "output_tokens": 6}},
    ]}  # fmt: skip
    out, usage_file = _claude(tmp_path, script, "Do something I will refuse.")
    # Claude Code takes the refusal and asks once more (2.1.332 does), then ends.
    assert out["result"] == "Understood; nothing was done.", out
    records = read_requests(usage_file)
    assert [r.stop_reason for r in records] == ["refusal", "end_turn"]
    assert read_usage(usage_file).output == 12 + 6  # the refused turn is billed too
