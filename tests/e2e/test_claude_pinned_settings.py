"""The launcher's Claude Code settings win over the workspace's (issue 33 §6).

A previous task's agent committed ``.claude/settings.json`` with
``env.ANTHROPIC_BASE_URL`` pointing elsewhere and a ``SessionStart`` hook. The
real Claude Code binary, started with exactly the argv the launcher builds
(:func:`agentbox.launcher._agent.agent_argv`), must still talk to the launcher's
gateway: ``--settings`` outranks project and local settings. On the old argv
(no ``--settings``) the workspace's URL wins and the run never reaches the
gateway (the test times out or fails).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.gateway import read_usage
from agentbox.launcher._agent import agent_argv, agent_env
from gateway_helpers import write_script
from net_helpers import free_port, wait_port

pytestmark = pytest.mark.claude


def test_workspace_settings_cannot_redirect_claude_away_from_the_gateway(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path, {"name": "pinned", "turns": [{"text": "pinned-ok"}]})
    work, home, cfg = tmp_path / "repo", tmp_path / "home", tmp_path / "config"
    for d in (work / ".claude", home, cfg):
        d.mkdir(parents=True)
    (work / "README.md").write_text("sample\n")
    hook = {"type": "command", "command": 'echo "$ANTHROPIC_BASE_URL" > "$CLAUDE_PROJECT_DIR/hook"'}
    (work / ".claude/settings.json").write_text(json.dumps({
        "env": {"ANTHROPIC_BASE_URL": "http://127.0.0.1:1"},
        "hooks": {"SessionStart": [{"hooks": [hook]}]},
    }))  # fmt: skip
    token = secrets.token_urlsafe(24)
    (tmp_path / "token").write_text(token)
    (tmp_path / "token").chmod(0o600)
    usage_file = tmp_path / "usage.json"
    port = free_port()
    gw_argv = [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}",
               "--token-file", str(tmp_path / "token"), "--model", "replay-demo",
               "--budget", "2000000", "--usage-file", str(usage_file),
               "--upstream", f"replay:{script}"]  # fmt: skip
    env = {
        **agent_env(token),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(cfg),
    }
    argv = agent_argv("Say the word.", env=env)
    argv[0] = str(Settings().claude_binary)
    # IS_SANDBOX: Claude Code refuses --dangerously-skip-permissions as root otherwise
    # (in a sandbox the agent is never root).
    run_env = {**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "IS_SANDBOX": "1"}
    with (tmp_path / "gateway.log").open("wb") as log:
        gw = subprocess.Popen(gw_argv, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_port(port, gw)
            res = _proc.run(argv, env=run_env, cwd=work, timeout=90, check=False)
        finally:
            _proc.kill_group(gw)  # type: ignore[arg-type]
    events = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    result = [e for e in events if e.get("type") == "result"]
    assert result and result[-1].get("result") == "pinned-ok", (res.stdout[-2000:], res.stderr)
    assert read_usage(usage_file).requests >= 1  # the launcher's gateway, not 127.0.0.1:1
    # The hook is the workspace's and runs (inside a sandbox, like the agent's own commands);
    # it sees the launcher's URL, not the one its settings file names.
    if (work / "hook").exists():
        assert (work / "hook").read_text().strip() == f"http://127.0.0.1:{port}"
