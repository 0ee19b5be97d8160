"""``agentbox run --runtime`` (issue 13 section 5): the OCI runtime chosen on the command
line, as ``exec`` and ``shell`` take it, without writing a Boxfile.

The real CLI in its own process, the real Claude Code with the replay model, podman
with gVisor. What shows the runtime reached the sandbox: the launcher lets gVisor's
gofer uid (and only for runsc) through to the task's workspace, and the task is done.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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


def _can_stat(uid: int, path: Path) -> bool:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "stat", str(path)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def _sample(base: Path, *, boxfile: str | None = None) -> tuple[Path, dict[str, str]]:
    """The demo's sample repo committed under ``base/repos`` (with ``boxfile`` as its
    committed ``.agentbox/Boxfile.toml``), and an environment whose data dir is ``base``'s."""
    repo = base / "repos" / "proj"
    shutil.copytree(ROOT / "demo" / "sample-repo", repo)
    if boxfile is not None:
        (repo / ".agentbox").mkdir()
        (repo / ".agentbox" / "Boxfile.toml").write_text(boxfile)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "sample")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return repo, env


def test_run_takes_the_runtime_from_the_command_line() -> None:
    fac = _host.podman_runtime("runsc")
    if not fac.ok:
        pytest.skip(f"runsc: {fac.detail}")
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-runtime-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        repo, env = _sample(base)
        argv = [sys.executable, "-m", "agentbox", "run", "--repo", str(repo), "--json"]
        argv += ["--runtime", "runsc", "Add a slugify helper with a test, and run the tests."]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            raise AssertionError(f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}") from None
        task = doc["task"]
        assert task["status"] == "done", (task["error"], r.stderr[-2000:])
        assert "def slugify" in git(repo, "show", f"{task['branch']}:textutil.py")
        # Only a runsc task lets gVisor's gofer (the mapped root of its uid slot, the one
        # user its task dir's ACL names) reach the workspace.
        root = base / "data" / "tasks" / task["id"]
        named = [uid for tag, _perm, uid in _acl._read(root) or [] if tag == _acl._USER]
        assert len(named) == 1 and named[0] >= Settings().subid_base, named
        assert _can_stat(named[0], root / "workspace")

        # Refused up front, in the Boxfile's words, before anything starts.
        bad = subprocess.run(
            [*argv[:-3], "--runtime", "kata", "x"], env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert bad.returncode != 0 and "runsc" in bad.stderr + bad.stdout, bad
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_runtime_flag_keeps_the_committed_boxfile_and_repo_defaults_to_the_cwd() -> None:
    """Issue 34 items 1, 4, 7: ``agentbox run --runtime runc`` in the repo's directory,
    without ``--repo``, on a repo whose committed Boxfile has a ``[setup]``: setup runs
    (the flag overrode the runtime only), and the report, ``show --json`` and ``show``
    say which backend and runtime the task ran on. The old CLI said ``Missing option
    '--repo'``, and with ``--repo`` it dropped the Boxfile: no setup, and still done."""
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-boxkeep-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        repo, env = _sample(
            base, boxfile='[setup]\nrun = ["mkdir -p .tools && echo ready > .tools/marker"]\n'
        )
        argv = [sys.executable, "-m", "agentbox", "run", "--json", "--runtime", "runc",
                "Add a slugify helper with a test, and run the tests."]  # fmt: skip
        r = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True, timeout=900)
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            raise AssertionError(f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}") from None
        task, report = doc["task"], doc["result"]["report"]
        assert task["status"] == "done", (task["error"], r.stderr[-2000:])
        assert task["repo"] == str(repo)
        setup = report.get("setup")
        assert setup is not None and setup["ran"] and setup["cache"] == "miss", report
        assert (task["backend"], task["runtime"]) == ("podman", "runc")
        assert (report["backend"], report["runtime"]) == ("podman", "runc")
        shown = subprocess.run(
            [sys.executable, "-m", "agentbox", "show", task["id"], "--no-diff"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "podman (runtime runc)" in shown.stdout, shown
    finally:
        _remove_envs_of(base)
        shutil.rmtree(base, ignore_errors=True)


def _remove_envs_of(base: Path) -> None:
    """The frozen environments of repos under ``base`` (they live in the host's cache dir,
    not in ``base``): a test leaves none behind."""
    from agentbox.config import Settings
    from agentbox.env import EnvStore

    store = EnvStore(Settings())
    for info in store.list():
        if str(base) in info.repo:
            store.remove(info.key, force=True)
