"""MCP ``publish(task_id, pr=true)`` through the real launcher service (issue 28 §5).

The official ``mcp`` SDK client calls the real ``agentbox mcp`` server (dropped to the
repo owner's uid), which fetches the branch into the repo as that user and asks the real
``agentbox launcher serve`` to push it (as the repo's owner, to a ``file://`` bare remote)
and open the pull request with the owner's own ``agentbox secret`` GITHUB_TOKEN, on a
local GitHub API server that validates each request against GitHub's OpenAPI description.
No sandbox runs: the task is finished by the launcher's own collect step on an edit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from test_collect_support import git, make_repo
from test_mcp_launcher import ensure_socket_group

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from forge_servers import ForgeServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root")

OWNER = 64124  # no passwd entry: an identity that owns the repo and nothing else
TOKEN = "ghp_mcptest_c0ffee0123456789abcd"


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="agentbox-prmcp-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _finished(settings: Settings, tid: str) -> tuple[Path, Path, str]:
    from agentbox.collect import prepare
    from agentbox.launcher import _finish, _runner
    from agentbox.launcher._context import TaskContext, TaskLog
    from agentbox.launcher._store import Store

    repo = make_repo(settings.repos_root / "proj", {"README.md": "hello\n"})
    remote = settings.repos_root.parent / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    git(repo, "remote", "add", "origin", "https://github.com/octo/hello.git")
    git(repo, "remote", "set-url", "--push", "origin", f"file://{remote}")
    paths = TaskPaths(settings.data_dir, tid)
    store = Store(settings.data_dir / "state.db")
    _runner._make_task_dir(paths)
    base = prepare(repo, paths.workspace, paths.shadow_git, paths.base_index)
    _finish.save_base(paths, base)
    (paths.workspace / "README.md").write_text("hello, world\n")
    store.insert(
        id=tid, status="running", repo=str(repo.resolve()), task="Greet the world",
        model="replay-demo", budget=5, deadline=3600.0, created_at=time.time(), publish=0,
        caller_uid=OWNER,
    )  # fmt: skip
    _finish.collect_and_finish(
        TaskContext(settings, store, paths, TaskLog(paths, store)), store.get(tid),
        status="done", error=None, exit_code=0,
    )  # fmt: skip
    commit = store.get(tid).commit_id
    assert commit
    for p in (repo, remote, settings.repos_root):
        subprocess.run(["chown", "-R", "-h", f"{OWNER}:{OWNER}", str(p)], check=True)
    return repo, remote, commit


def test_mcp_publish_pr_pushes_as_the_owner_and_opens_the_pull_request(base: Path) -> None:
    from agentbox.secrets import SecretStore

    ensure_socket_group()
    (base / "repos").mkdir()
    settings = Settings(data_dir=base / "data", repos_root=base / "repos")
    tid = "t-mcppr"
    _repo, remote, commit = _finished(settings, tid)
    SecretStore(settings).set("GITHUB_TOKEN", TOKEN, OWNER)
    with ForgeServer("github") as server:
        env = {
            "PATH": os.environ["PATH"], "HOME": str(base),
            "AGENTBOX_DATA_DIR": str(settings.data_dir),
            "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
            "AGENTBOX_FORGE_HOSTS": f"github.com=github:{server.url}",
        }  # fmt: skip
        launcher = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            sock = settings.data_dir / "launcher.sock"
            end = time.monotonic() + 120
            while not sock.exists():
                assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
                assert time.monotonic() < end, "the launcher's socket never appeared"
                time.sleep(0.2)
            client = Client(
                StdioServerParameters(
                    command=sys.executable,
                    args=["-m", "agentbox", "mcp", "--user", str(OWNER)],
                    env=env,
                ),
                read_timeout_seconds=300,
            )

            async def call() -> tuple[bool, str]:
                async with client:
                    res = await client.call_tool("publish", {"task_id": tid, "pr": True})
                    return res.is_error, " ".join(getattr(c, "text", "") for c in res.content)

            is_error, text = anyio.run(call)
            # The SDK (as root here) on the same launcher: nothing pushed twice, the open
            # pull request returned.
            from agentbox.sdk import Client as SdkClient

            with SdkClient(sock) as sdk:
                again = sdk.tasks.get(tid).push(pr=True)
        finally:
            with launcher:
                launcher.send_signal(signal.SIGTERM)
                launcher.wait(60)
    assert not is_error, text
    assert f"branch agentbox/{tid} (commit {commit}) pushed to origin" in text
    assert "pull request opened: https://github.com/octo/hello/pull/1347" in text
    assert server.errors == []
    (create,) = [r for r in server.requests if r.method == "POST"]
    assert create.headers["authorization"].endswith(TOKEN)  # the owner's own secret
    assert create.body["head"] == f"agentbox/{tid}" and "Greet the world" in create.body["body"]
    out = subprocess.run(["git", "--git-dir", str(remote), "rev-parse", f"agentbox/{tid}"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == commit
    owners = {p.stat().st_uid for p in (remote / "objects").rglob("*") if p.is_file()}
    assert owners == {OWNER}
    assert TOKEN not in text
    assert not again.pushed and again.existed
    assert again.pull_request == "https://github.com/octo/hello/pull/1347"
