"""The SDK's best-of-N: ``Client().tasks.create(…, attempts=2)`` against a real launcher
service (its socket), real podman and Claude Code, the replay model: a TaskGroup whose
attempts share the split budget, its view scores them, the service publishes the pick as
``agentbox/<group>`` when the last ends, and ``publish(pick=2)`` moves it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentbox.sdk import AsyncClient, AsyncTaskGroup, Client
from gateway_helpers import greet_script
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]


async def _async_side(sock: Path, repo: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with AsyncClient(address=sock) as c:
        old = await c.tasks.group("sg2")
        out["ids"] = [t.id for t in old.tasks]
        moved = await old.publish(pick=1)
        out["moved"] = (moved.id, moved.branch)
        g = await c.tasks.create(repo, "Add a greet function", model="quick", attempts=1,
                                 budget_tokens=2_000_000, task_id="as1",
                                 budget_split="shared")  # fmt: skip
        assert isinstance(g, AsyncTaskGroup)
        out["new"] = (g.id, [t.id for t in g.tasks], g.tasks[0].info.budget)
        view = await g.wait(timeout=600)
        if view.branch is None and view.pick is not None:
            await g.publish()
            view = await g.view()
        out.update(split=view.budget_split, pick=view.pick, spent=view.group_spent,
                   status=[a.status for a in view.attempts])  # fmt: skip
    return out


def test_sdk_group_of_two() -> None:
    base = Path(tempfile.mkdtemp(prefix="agentbox-sdk-attempts-", dir="/var/tmp"))
    base.chmod(0o711)
    (base / "repos").mkdir()
    (base / "quick.yaml").write_text(greet_script("quick"))
    (base / "models.toml").write_text('[models.quick]\nkind = "replay"\nupstream = "quick.yaml"\n')
    env = {
        "PATH": os.environ["PATH"], "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"), "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }  # fmt: skip
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    repo = base / "repos" / "proj"
    repo.mkdir()
    (repo / "README.md").write_text("hello\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
    serve = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        sock = base / "data" / "launcher.sock"
        for _ in range(600):
            if sock.exists():
                break
            assert serve.poll() is None, "the launcher exited"
            time.sleep(0.1)
        with Client(address=sock) as c:
            group = c.tasks.create(repo, "Add a greet function", model="quick", attempts=2,
                                   budget_tokens=2_000_000, task_id="sg2")  # fmt: skip
            assert group.id == "sg2" and [t.id for t in group.tasks] == ["sg2-a1", "sg2-a2"]
            assert all(t.info.budget == 1_000_000 for t in group.tasks)
            view = group.wait(timeout=600)
            assert [a.status for a in view.attempts] == ["done", "done"], view
            assert view.pick == 1 and view.pick_id == "sg2-a1"  # same diff: the lower index
            for _ in range(120):  # published by the service just after the last attempt
                if view.branch:
                    break
                time.sleep(0.5)
                view = group.view()
            assert view.branch == "agentbox/sg2"
            moved = group.publish(pick=2)
            assert moved.id == "sg2-a2" and moved.branch == "agentbox/sg2"
        assert git(repo, "rev-parse", "agentbox/sg2") == git(repo, "rev-parse", "agentbox/sg2-a2")
        # The async client: the same group found by id, moved back to its pick; then a new
        # group (one attempt, a shared budget) created, waited for and published.
        got = anyio.run(_async_side, sock, repo)
        assert got["moved"] == ("sg2-a1", "agentbox/sg2") and got["ids"] == ["sg2-a1", "sg2-a2"]
        assert git(repo, "rev-parse", "agentbox/sg2") == git(repo, "rev-parse", "agentbox/sg2-a1")
        assert got["new"] == ("as1", ["as1-a1"], 2_000_000), got
        assert got["split"] == "shared" and got["pick"] == 1 and got["status"] == ["done"], got
        assert got["spent"] is not None and 0 < got["spent"] <= 2_000_000, got
        assert git(repo, "rev-parse", "agentbox/as1") == git(repo, "rev-parse", "agentbox/as1-a1")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(base, ignore_errors=True)
