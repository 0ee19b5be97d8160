"""The real Claude Code binary through the gateway, playing the demo replay script.

Claude Code talks to the gateway on TCP loopback (as it does inside a sandbox,
where a relay carries that port to the gateway's socket), authenticates with the
task token, and runs the script's tools (Write, Edit, Bash) on the host in a
temp dir. The gateway runs as its own process, started like the CLI does.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentbox import _proc
from agentbox.config import Settings
from agentbox.gateway import DEMO_SCRIPT, read_usage

pytestmark = pytest.mark.claude


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gateway exited early"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError("gateway did not listen")


def test_claude_completes_demo_script_through_gateway(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    home = tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "README.md").write_text("sample repo\n")
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    usage_file = tmp_path / "usage.json"
    port = _free_port()
    argv = [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}"]
    argv += ["--token-file", str(token_file), "--model", "replay-demo", "--budget", "2000000"]
    argv += ["--usage-file", str(usage_file)]
    log = (tmp_path / "gateway.log").open("wb")
    gw = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    try:
        _wait_port(port, gw)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": token,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        res = _proc.run(
            [
                str(Settings().claude_binary),
                "-p",
                "Add a slugify helper with a unit test, and run the tests.",
                "--output-format",
                "json",
                "--allowedTools",
                "Write Edit Read Bash",
            ],
            env=env,
            cwd=work,
            timeout=240,
        )
    finally:
        _proc.kill_group(gw)  # type: ignore[arg-type]
        log.close()
    out = json.loads(res.stdout)
    assert out["is_error"] is False, out
    assert out["num_turns"] == 5
    assert "passes (2 tests)" in out["result"]
    code = (work / "textutil.py").read_text()
    assert "def slugify" in code and "punctuation is dropped" in code  # Write, then Edit
    assert "class SlugifyTest" in (work / "test_textutil.py").read_text()
    # The tests really ran on the host (Bash tool): they left their bytecode.
    assert any((work / "__pycache__").glob("textutil*.pyc"))
    usage = read_usage(usage_file)
    # Exactly the usage the script declares (see demo.yaml), and nothing refused.
    assert (usage.input, usage.output) == (3610, 420)
    assert (usage.cache_creation, usage.cache_read) == (9000, 38000)
    assert usage.weighted_total == pytest.approx(3610 + 420 + 9000 * 1.25 + 38000 * 0.1)
    assert usage.requests == 5 and usage.refusals == {} and usage.reserved == 0
    assert DEMO_SCRIPT.is_file()
