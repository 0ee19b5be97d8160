"""End to end through the warm pool (issue 15 item 3): the real Claude Code binary in a
pooled podman sandbox, driven by the replay model; the result is a branch in a real repo.

The keeper ``launcher serve`` runs fills a pool of one; a task submitted to a launcher
claims it (the claim is observed, not assumed: a spy around the real ``claim``), runs
to ``done`` with its edits on a branch, and the keeper's stop drains the refill.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.podman import _pool
from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._pool import start_pool
from git_helpers import git
from mount_helpers import assert_no_mounts_under

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "demo" / "sample-repo"
EDIT_SCRIPT = ROOT / "demo" / "replay-edit.yaml"


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="agentbox-e2e-pool-", dir="/var/tmp"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_claude_code_task_through_the_pool(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbox.image import build_default

    build_default(Settings())
    (base / "models.toml").write_text(
        f'[models.replay-edit]\nkind = "replay"\nupstream = "{EDIT_SCRIPT}"\n'
    )
    (base / "data").mkdir()
    (base / "repos").mkdir()
    settings = Settings(
        data_dir=base / "data",
        repos_root=base / "repos",
        models_file=base / "models.toml",
        pool_size=1,
    )
    claims: list[tuple[str, bool]] = []
    real_claim = _pool.claim

    def spy(backend: Any, spec: Any, argv: Any, *, log_path: Path) -> bool:
        got = real_claim(backend, spec, argv, log_path=log_path)
        claims.append((spec.name, got))
        return got

    monkeypatch.setattr(_pool, "claim", spy)
    repo = settings.repos_root / "edit"
    shutil.copytree(SAMPLE, repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "sample")
    keeper = start_pool(settings)
    assert keeper is not None
    launcher = Launcher(settings, max_tasks=1)
    try:
        end = time.monotonic() + 300  # the keeper's first fill (bounded, not timed)
        while not list((_pool.pool_dir(settings) / "slots").glob("*/ready")):
            assert time.monotonic() < end, "the keeper filled no sandbox"
            time.sleep(0.2)
        req = TaskRequest(
            repo=str(repo), task="e2e pool: add multiply", model="replay-edit", deadline=300.0
        )
        task_id = launcher.submit(req).id
        info = launcher.wait(task_id, timeout=600)
        result = launcher.result(task_id)
    finally:
        launcher.close()
        keeper.stop()
    assert claims and claims[0][1] is True, claims  # the task's sandbox came from the pool
    assert info.status == "done", info.error
    assert info.exit_code == 0
    core = git(repo, "show", f"{result.branch}:calc/core.py")
    assert "def multiply(a: float, b: float) -> float:" in core
    assert "passes" in result.report["final_message"]
    assert not list((_pool.pool_dir(settings) / "slots").iterdir())
    assert_no_mounts_under(settings.data_dir)
