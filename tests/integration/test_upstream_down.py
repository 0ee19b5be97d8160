"""Issue 34 item 2: a model upstream that is down is said at once, not at the deadline.

A local (loopback) ``compatible`` upstream is checked when the task is submitted; the
real gateway, in front of an upstream where nothing listens, gives up after a few
failures in a row and refuses from then on, naming the registry entry, the upstream and
the error; the launcher ends the task with that as its error, and the transcript
(``logs``, ``run``'s progress) shows each upstream failure as it comes.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

from agentbox.backends.fake import FakeBackend, FakeSandbox, FakeScript
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import UpstreamConnectError
from agentbox.gateway._forward import UPSTREAM_DOWN_AFTER
from agentbox.gateway._usage import Usage, write_usage
from agentbox.gateway.registry import ModelEntry
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._reach import check_local_upstream
from agentbox.transcript import read_transcript
from gateway_helpers import running_gateway
from git_helpers import git

sys.path.insert(0, str(Path(__file__).parent))
import test_lifecycle_fake

#: The fake as the default backend with the stand-in gateway (test_lifecycle_fake.fake).
fake = test_lifecycle_fake.fake

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def repo(settings: Settings) -> Path:
    path = settings.repos_root / "proj"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def test_a_local_upstream_is_checked_when_submitted(settings: Settings, repo: Path) -> None:
    port = _free_port()
    models = settings.data_dir.parent / "models.toml"
    models.write_text(
        f'[models.qwen-local]\nkind = "compatible"\nupstream = "http://127.0.0.1:{port}"\n'
    )
    s = settings.model_copy(update={"models_file": models})
    with Launcher(s, max_tasks=1) as la:
        with pytest.raises(UpstreamConnectError, match=f"nothing listens on 127.0.0.1:{port}"):
            la.submit(TaskRequest(repo=str(repo), task="x", model="qwen-local"))
        assert la.list() == []  # refused before anything was made
    with socket.socket() as listening:  # something listens: it passes
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = ModelEntry(name="up", kind="compatible",
                        upstream=f"http://127.0.0.1:{listening.getsockname()[1]}")  # fmt: skip
        check_local_upstream(up)
    check_local_upstream(ModelEntry(name="far", kind="compatible", upstream="https://example.com"))


def test_the_gateway_gives_up_on_an_upstream_that_is_down(tmp_path: Path) -> None:
    port = _free_port()
    entry = ModelEntry(name="qwen-local", kind="compatible", upstream=f"http://127.0.0.1:{port}")
    body = {"model": "x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with running_gateway(tmp_path, upstream=f"http://127.0.0.1:{port}", entry=entry) as gw:
        with httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=30) as c:
            codes = [c.post("/v1/messages", json=body).status_code for _ in range(6)]
            last = c.post("/v1/messages", json=body)
        usage = gw.usage()
    assert codes[:UPSTREAM_DOWN_AFTER] == [502] * UPSTREAM_DOWN_AFTER, codes
    assert codes[UPSTREAM_DOWN_AFTER:] == [403] * (6 - UPSTREAM_DOWN_AFTER), codes
    assert last.status_code == 403 and "gave up" in last.text
    down = usage.upstream_down
    assert "'qwen-local'" in down and f"http://127.0.0.1:{port}" in down, down
    assert f"{UPSTREAM_DOWN_AFTER} times in a row" in down and usage.upstream_error in down
    assert usage.refusals.get("upstream_down") == 3


@needs_root
def test_the_task_ends_naming_the_upstream_and_logs_show_each_failure(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    down = "model 'qwen-local' (compatible): its upstream http://127.0.0.1:9 failed 4 times"
    seen: list[list[str]] = []

    def failing(box: FakeSandbox, argv: object) -> None:
        # What the gateway writes as its upstream fails, then gives up.
        root = TaskPaths(settings.data_dir, box.name.removeprefix("agentbox-task-")).root
        for n in (1, 2):
            u = Usage(upstream_errors=n, upstream_failing=n, upstream_error="connection refused")
            write_usage(root / "usage.json", u)
            seen.append([e.text for e in read_transcript(root).events if e.kind == "error"])
        write_usage(root / "usage.json", Usage(upstream_errors=4, upstream_failing=4,
                                               upstream_error="connection refused",
                                               upstream_down=down))  # fmt: skip

    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(action=failing, exit_code=1)),
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="x")).id
        info = la.wait(tid, timeout=60)
        res = la.result(tid)
    assert info.status == "failed" and info.error is not None
    assert info.error.startswith("the model's upstream is down: ") and down in info.error
    assert res.report["usage"]["upstream_down"] == down
    assert res.report["usage"]["upstream_errors"] == 4
    # Each failure is a line of its own as it happens (a follower prints each new one).
    assert "(1 in a row, 1 errors in all); last: connection refused" in seen[0][0], seen
    assert "(2 in a row, 2 errors in all)" in seen[1][0], seen
