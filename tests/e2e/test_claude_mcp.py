"""The seed's headline flow: the user's own Claude Code delegates through MCP.

A host-side ``claude -p`` (the real binary, HOME in a temp dir) is driven by a
host-side replay model whose script calls ``mcp__agentbox__delegate`` with
``wait=true``. agentbox's MCP server (stdio, spawned by claude from an
``--mcp-config`` file, or streamable HTTP added with the exact ``claude mcp add``
line ``agentbox serve`` prints) asks the real
launcher, which runs the sandboxed Claude Code in podman through its own gateway
and replay model. The host side must get the diff back: the host script's next
turn only says ``DELEGATION-OK`` if the tool result it received contains the
agent's change, and the branch must be in the user's repo.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.mcp import claude_add_command, token_path
from gateway_helpers import greet_script
from git_helpers import git
from net_helpers import free_port, wait_port

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

MCP_UID = 64123
AGENTBOX = (sys.executable, "-m", "agentbox")


def host_script(repo: Path) -> str:
    args = json.dumps({"repo": str(repo), "task": "Add a greet(name) function", "wait": True})
    return f"""\
name: host
main: tools
side_reply: "Delegate"
turns:
  - text: "I'll hand this to agentbox."
    tool_use:
      - name: mcp__agentbox__delegate
        input: {args}
  - branches:
      - match: "\\\\+def greet\\\\(name\\\\)"
        text: "DELEGATION-OK: the sandboxed agent added greet()."
      - text: "DELEGATION-FAILED"
"""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, object]]:
    import grp

    try:
        grp.getgrnam("agentbox")
    except KeyError:
        subprocess.run(["groupadd", "-f", "--system", "agentbox"], check=True)
    base = Path(tempfile.mkdtemp(prefix="agentbox-claude-mcp-"))
    base.chmod(0o755)
    repos = base / "repos"
    repos.mkdir()
    os.chown(repos, MCP_UID, MCP_UID)
    (base / "inner.yaml").write_text(greet_script("inner"))
    (base / "models.toml").write_text('[models.inner]\nkind = "replay"\nupstream = "inner.yaml"\n')
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(repos),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    if "PYTHONPATH" in os.environ:  # run against another source tree
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    launcher = subprocess.Popen(
        [*AGENTBOX, "launcher", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 60
        while not (base / "data" / "launcher.sock").exists():
            assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
            assert time.monotonic() < end
            time.sleep(0.1)
        yield {"base": base, "repos": repos, "env": env}
    finally:
        _stop(launcher)
        shutil.rmtree(base, ignore_errors=True)


def _new_repo(repos: Path, name: str) -> Path:
    path = repos / name
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    subprocess.run(["chown", "-R", "-h", f"{MCP_UID}:{MCP_UID}", str(path)], check=True)
    return path


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_host_claude_delegates_and_gets_the_diff(
    world: dict[str, object], transport: str, tmp_path: Path
) -> None:
    base = world["base"]
    env = world["env"]
    assert isinstance(base, Path) and isinstance(env, dict)
    repo = _new_repo(base / "repos", f"host-{transport}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # The host's own model: a replay script that calls the delegate tool.
        (tmp_path / "host.yaml").write_text(host_script(repo))
        mport = free_port()
        argv = [*AGENTBOX, "model", "serve", "--script", str(tmp_path / "host.yaml")]
        argv += ["--listen", f"tcp:127.0.0.1:{mport}", "--log-requests", str(tmp_path / "r.jsonl")]
        model = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        procs.append(model)
        wait_port(mport, model)

        if transport == "stdio":
            server = {
                "type": "stdio",
                "command": sys.executable,
                "args": ["-m", "agentbox", "mcp", "--user", str(MCP_UID)],
                "env": {k: v for k, v in env.items() if k.startswith(("AGENTBOX_", "PYTHON"))},
            }
        else:
            port = free_port()
            mcp = subprocess.Popen(
                [*AGENTBOX, "mcp", "--http", f"127.0.0.1:{port}", "--user", str(MCP_UID)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(mcp)
            wait_port(port, mcp)
            token = token_path(Path(env["AGENTBOX_DATA_DIR"])).read_text().strip()
            server = None  # added below with the exact line `agentbox serve` prints
        home = tmp_path / "home"
        home.mkdir()
        claude_env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{mport}",
            "ANTHROPIC_API_KEY": "sk-host-replay",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "MCP_TOOL_TIMEOUT": "600000",
        }
        claude = str(Settings().claude_binary)
        argv = [claude, "-p", "Add a greet function to my repo."]
        if server is not None:
            config = tmp_path / "mcp.json"
            config.write_text(json.dumps({"mcpServers": {"agentbox": server}}))
            argv += ["--mcp-config", str(config), "--strict-mcp-config"]
        else:
            add = shlex.split(claude_add_command("127.0.0.1", port, token))
            assert add[0] == "claude"
            subprocess.run(
                [claude, *add[1:]], env=claude_env, cwd=tmp_path, check=True, capture_output=True
            )
        argv += ["--allowedTools", "mcp__agentbox__delegate"]
        argv += ["--output-format", "stream-json", "--verbose"]
        res = subprocess.run(
            argv,
            env=claude_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        events = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        final = [e for e in events if e.get("type") == "result"]
        assert final, res.stdout[-3000:] + res.stderr[-3000:]
        tool_results = [
            e.get("tool_use_result")
            for e in events
            if e.get("type") == "user" and e.get("tool_use_result") is not None
        ]
        assert tool_results, res.stdout[-3000:]
        got = json.dumps(tool_results)
        assert "+def greet(name):" in got, got[-3000:]
        assert final[-1]["result"].startswith("DELEGATION-OK"), final[-1]
        # The branch is in the user's repo; the working tree is untouched.
        branches = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/agentbox")
        assert len(branches.split()) == 1, branches
        assert "hello" in git(repo, "show", f"{branches.strip()}:greet.py")
        assert not (repo / "greet.py").exists()
    finally:
        for p in procs:
            _stop(p)
