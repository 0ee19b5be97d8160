"""End to end through ``agentbox run`` (its own process, piped, as CI runs it): a task on
gVisor (runsc), a failure before the agent starts, and a budget too small for the task.

Issue 13: runsc tasks failed ("runsc's gofer … cannot reach /var/lib/agentbox/tasks/…",
the data dir is 0710 and the gofer is another uid); a task whose image is missing was
reported as "no changes" with a raw structlog line on stderr; a budget refusal looked
like an authentication error or "no changes".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.linux import acl as _acl
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "demo" / "sample-repo"
#: A structlog console line: ISO time, then a [level] in brackets.
STRUCTLOG = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z? \[\s*\w+\s*\]", re.M)


@dataclass
class World:
    base: Path
    env: dict[str, str]

    def repo(self, name: str) -> Path:
        path = self.base / "repos" / name
        shutil.copytree(SAMPLE, path)
        git(path, "init", "-q", "-b", "main")
        git(path, "add", "-A")
        git(path, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "sample")
        return path

    def run(self, *args: str, boxfile: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "agentbox", "run", *args]
        if boxfile is not None:
            path = self.base / f"Boxfile-{len(list(self.base.glob('Boxfile-*')))}.toml"
            path.write_text(boxfile)
            argv += ["--boxfile", str(path)]
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=900, check=False
        )


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-cli-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "COLUMNS": "80",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        yield World(base, env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (rc {r.returncode}):\n{r.stdout}\n{r.stderr}") from None
    assert isinstance(doc, dict)
    return doc


def test_a_task_on_runsc(world: World) -> None:
    fac = _host.podman_runtime("runsc")
    if not fac.ok:
        pytest.skip(f"runsc: {fac.detail}")
    repo = world.repo("gvisor")
    r = world.run(
        "--repo", str(repo), "--json", "Add a slugify helper with a test, and run the tests.",
        boxfile='runtime = "runsc"\n',
    )  # fmt: skip
    doc = _json(r)
    task = doc["task"]
    assert task["status"] == "done", (task["error"], r.stderr[-2000:])
    assert task["branch"] == f"agentbox/{task['id']}"
    assert "def slugify" in git(repo, "show", f"{task['branch']}:textutil.py")
    assert "passes" in doc["result"]["report"]["final_message"]
    # The task dir stays closed to everyone else: only the gofer's uid was let through.
    root = world.base / "data" / "tasks" / task["id"]
    assert root.stat().st_mode & 0o007 == 0 and root.parent.stat().st_mode & 0o007 == 0
    # The gofer is the mapped root of the task's own uid slot: the one named user its
    # ACL lets search, within the slots' ids above subid_base.
    named = [uid for tag, _perm, uid in _acl._read(root) or [] if tag == _acl._USER]
    assert len(named) == 1, named
    gofer = named[0]
    assert gofer >= Settings().subid_base, gofer
    assert _can_stat(gofer, root / "workspace")
    assert not _can_stat(gofer + 7, root / "workspace")  # another uid of the same range
    assert not _can_stat(65534, root / "workspace")  # nobody


def _can_stat(uid: int, path: Path) -> bool:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "stat", str(path)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def test_a_missing_image_says_so(world: World) -> None:
    repo = world.repo("noimage")
    r = world.run(
        "--repo", str(repo), "Do anything.",
        boxfile='image = "localhost/agentbox-no-such-image:latest"\n',
    )  # fmt: skip
    assert r.returncode == 1, r
    assert "no changes" not in r.stdout, r.stdout
    assert "agentbox-no-such-image" in r.stdout and "never started" in r.stdout, r.stdout
    assert not STRUCTLOG.search(r.stderr), r.stderr


def test_a_budget_too_small_says_budget_exhausted(world: World) -> None:
    repo = world.repo("budget")
    r = world.run("--repo", str(repo), "--budget", "20000", "Add a slugify helper.")
    assert r.returncode == 1, r
    out = " ".join(r.stdout.split())
    assert "budget exhausted after 0 of 20,000 tokens" in out, r.stdout
    assert "no changes" not in out and "authenticate" not in out.split("agent's last")[0]
    # Claude Code's own words for the 403 ("Failed to authenticate") are labelled as such.
    assert "agent's last message (a budget refusal" in out
    assert "no changes" not in r.stderr and not STRUCTLOG.search(r.stderr), r.stderr


def test_a_100k_budget_lets_the_first_call_through(world: World) -> None:
    """Claude Code's first call reserves ~190k at max_tokens 128000: clamped, it goes."""
    repo = world.repo("clamped")
    r = world.run(
        "--repo", str(repo), "--budget", "100000", "--json",
        "Add a slugify helper with a test, and run the tests.",
    )  # fmt: skip
    doc = _json(r)
    usage = doc["result"]["report"]["usage"]
    assert usage["requests"] >= 1 and usage["weighted_total"] > 0, (usage, r.stderr[-2000:])
    assert usage["clamped"] >= 1
    assert usage["weighted_total"] <= 100_000
