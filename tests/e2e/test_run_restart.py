"""A launcher killed (SIGKILL) while its task runs; a new launcher takes it over.

``agentbox launcher serve`` runs as a real process; the task is submitted through
the real unix-socket client; the agent (real Claude Code in the podman sandbox)
has written a file and is in a long command when the launcher dies. On podman the
sandbox and gateway go on without it (detached; no watchdog) and the new launcher
re-adopts the task (issue 19); a microVM's task is reaped by its watchdog and the
new launcher collects what the agent wrote, publishes it and marks the task.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.gateway import read_usage, spawn_gateway
from agentbox.launcher import LauncherClient, TaskRequest
from mount_helpers import assert_no_mounts_under

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

ROOT = Path(__file__).resolve().parents[2]

SLOW_SCRIPT = """\
name: slow
turns:
  - text: "Writing, then a long command."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/partial.txt", content: "written before the launcher died\\n"}
  - tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(240)'"
          description: "A long command"
          timeout: 600000
  - text: "Done."
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def _wait_in_long_command(
    client: LauncherClient, task_id: str, paths: TaskPaths, *, timeout: float
) -> None:
    """Until the agent wrote its file and is inside its long command (2 model turns)."""
    end = time.monotonic() + timeout
    while True:
        info = client.get(task_id)
        assert not info.terminal, info
        try:
            if info.status == "running" and read_usage(paths.usage_file).requests >= 2:
                return
        except Exception:  # the usage file appears with the gateway
            pass
        assert time.monotonic() < end, "the agent never got to its long command"
        time.sleep(0.5)


def _env_traces(data_dir: Path) -> set[Path]:
    """``agentbox-env*`` entries in the temp dir and the data dir (not the workspaces)."""
    found = set(Path(tempfile.gettempdir()).glob("agentbox-env*"))
    for top, dirs, files in os.walk(data_dir):
        dirs[:] = [d for d in dirs if d not in ("workspace", "shadow.git")]
        found |= {Path(top, n) for n in dirs + files if n.startswith("agentbox-env")}
    return found


class Served:
    """``agentbox launcher serve`` as a child process with its own settings."""

    def __init__(self, env: dict[str, str], sock: Path) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert self.proc.poll() is None, "launcher exited"
            assert time.monotonic() < deadline, "launcher did not listen"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def world() -> Iterator[tuple[Settings, dict[str, str], Path]]:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-restart-", dir="/var/tmp"))
    base.chmod(0o711)
    (base / "slow.yaml").write_text(SLOW_SCRIPT)
    (base / "models.toml").write_text(
        '[models.replay-slow]\nkind = "replay"\nupstream = "slow.yaml"\n'
    )
    (base / "data").mkdir()
    (base / "repos").mkdir()
    repo = base / "repos" / "proj"
    shutil.copytree(ROOT / "demo" / "sample-repo", repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "s")
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    settings = Settings(
        data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
    )
    try:
        yield settings, env, repo
    finally:
        try:
            assert_no_mounts_under(base)  # no workspace disk, no settle mount (issue 19)
        finally:
            if not os.environ.get("E2E_KEEP_DIRS"):
                shutil.rmtree(base, ignore_errors=True)


def test_launcher_killed_mid_task_is_reconciled(
    world: tuple[Settings, dict[str, str], Path],
) -> None:
    settings, env, repo = world
    sock = settings.data_dir / "launcher.sock"
    env_before = _env_traces(settings.data_dir)
    first = Served(env, sock)
    second = None
    ghost_gw = None
    try:
        with LauncherClient(sock) as client:
            info = client.submit(
                TaskRequest(repo=str(repo), task="write, then wait", model="replay-slow",
                            deadline=600.0, task_id="restart-1")
            )  # fmt: skip
            paths = TaskPaths(settings.data_dir, info.id)
            _wait_in_long_command(client, info.id, paths, timeout=180)
            time.sleep(2.0)
        # Facts about what the dead launcher leaves running: a detached sandbox, its
        # gateway, and no per-task watchdog.
        import sqlite3

        db = sqlite3.connect(settings.data_dir / "state.db")
        gw_pid, wd_pid, stage = db.execute(
            "SELECT gateway_pid, watchdog_pid, stage FROM tasks WHERE id = 'restart-1'"
        ).fetchone()
        db.close()
        assert psutil.pid_exists(gw_pid) and wd_pid is None and stage == "launched"

        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        sock.unlink(missing_ok=True)
        time.sleep(3.0)
        # Nothing of the task went with its launcher.
        names = subprocess.run(
            ["podman", "ps", "--format", "{{.Names}}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert "agentbox-task-restart-1" in names, names
        assert psutil.Process(gw_pid).status() != psutil.STATUS_ZOMBIE
        # The sandbox's environment (its one-time gateway token) was never on disk, so
        # the SIGKILL left none behind.
        assert _env_traces(settings.data_dir) == env_before
        # What it used so far, as the dead launcher's sampler last wrote it (issue 30 §3).
        before = json.loads((paths.root / "resources.json").read_text())
        assert before["live"] is True and before["samples"] > 0 and before["cpu_s"] > 0

        # A gateway of this data dir that no task row names (a crash between its
        # spawn and the row update) is an orphan too.
        ghost = settings.data_dir / "tasks" / "ghost-1"
        (ghost / "gw").mkdir(parents=True)
        (ghost / "token").write_text(secrets.token_urlsafe(32))
        (ghost / "token").chmod(0o600)
        ghost_gw = spawn_gateway(
            socket_path=ghost / "gw" / "gateway.sock", token_file=ghost / "token",
            model="replay-slow", budget=10, usage_file=ghost / "usage.json", settings=settings,
        )  # fmt: skip

        second = Served(env, sock)  # reconciles before it listens
        ghost_gw._proc.wait(30)  # reaped here: reconcile killed it
        with LauncherClient(sock) as client:
            info = client.get("restart-1")
            assert info.status == "running", info  # re-adopted, still in its long command
            client.cancel("restart-1")  # the new launcher holds it: a cancel reaches it
            info = client.wait("restart-1", timeout=120)
            assert info.status == "cancelled", info
            res = client.result("restart-1")
        assert "re-adopted by launcher pid" in (paths.log_dir / "launcher.log").read_text()
        # The re-adopting launcher sampled on from the dead one's figures.
        used = res.report["resources"]
        assert used["live"] is False and used["samples"] > before["samples"], (before, used)
        assert used["cpu_s"] >= before["cpu_s"] and used["updated_at"] > before["updated_at"]
        assert any("re-adopted" in n for n in used["notes"]), used
        assert res.branch == "agentbox/restart-1"
        assert (
            _git(repo, "show", f"{res.branch}:partial.txt") == "written before the launcher died\n"
        )
        assert "partial.txt" in res.diff
        end = time.monotonic() + 30  # its removal is off the task's path: a bound, not a target
        while True:
            names = subprocess.run(
                ["podman", "ps", "-a", "--format", "{{.Names}}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            if "agentbox-task-restart-1" not in names or time.monotonic() > end:
                break
            time.sleep(0.5)
        assert "agentbox-task-restart-1" not in names
        assert not psutil.pid_exists(gw_pid) or psutil.Process(gw_pid).status() == (
            psutil.STATUS_ZOMBIE
        )
    finally:
        if ghost_gw is not None:
            ghost_gw.stop(grace=1.0)
        if second is not None:
            second.stop()
        first.stop()
        subprocess.run(
            ["podman", "rm", "-f", "-t", "0", "agentbox-task-restart-1"], capture_output=True
        )


def test_launcher_stop_cancel_cancels_and_collects(
    world: tuple[Settings, dict[str, str], Path],
) -> None:
    settings, env, repo = world
    sock = settings.data_dir / "launcher.sock"
    served = Served(env, sock)
    try:
        with LauncherClient(sock) as client:
            info = client.submit(
                TaskRequest(repo=str(repo), task="write, then wait", model="replay-slow",
                            deadline=600.0, task_id="sigterm-1")
            )  # fmt: skip
            paths = TaskPaths(settings.data_dir, info.id)
            end = time.monotonic() + 180
            while True:
                try:
                    if read_usage(paths.usage_file).requests >= 2:
                        break
                except Exception:
                    pass
                assert time.monotonic() < end, "the agent never got to its long command"
                time.sleep(0.5)
            time.sleep(1.0)
        # ``agentbox launcher stop --cancel`` (plain SIGTERM leaves running tasks to the
        # next launcher now: tests/e2e/test_live_restore.py).
        from agentbox.launcher import stop_launcher

        assert stop_launcher(settings.data_dir, "cancel", timeout=120) == served.proc.pid
        assert served.proc.wait(120) == 0
        assert not sock.exists()
        from agentbox.launcher import Launcher

        launcher = Launcher(settings)
        try:
            info = launcher.get("sigterm-1")
            assert info.status == "cancelled", info
            res = launcher.result("sigterm-1")
        finally:
            launcher.close()
        assert (
            _git(repo, "show", f"{res.branch}:partial.txt") == "written before the launcher died\n"
        )
    finally:
        served.stop()
        subprocess.run(
            ["podman", "rm", "-f", "-t", "0", "agentbox-task-sigterm-1"], capture_output=True
        )


@pytest.mark.qemu
def test_launcher_killed_mid_task_on_a_microvm_keeps_what_the_agent_wrote(
    world: tuple[Settings, dict[str, str], Path],
) -> None:
    """The same crash with the task in a microVM: the agent's file lives only on the
    VM's /data disk; the VM lives on (its monitor holds it), the next launcher
    re-adopts it, a cancel through it ends the VM and collects what the agent wrote."""
    settings, env, repo = world
    env = {**env, "AGENTBOX_BACKEND": "qemu"}  # the host default reaches socket tasks
    sock = settings.data_dir / "launcher.sock"
    base = str(settings.data_dir.parent)
    first = Served(env, sock)
    second = None
    try:
        with LauncherClient(sock) as client:
            info = client.submit(
                TaskRequest(repo=str(repo), task="write, then wait", model="replay-slow",
                            deadline=600.0, task_id="restart-vm")
            )  # fmt: skip
            paths = TaskPaths(settings.data_dir, info.id)
            _wait_in_long_command(client, info.id, paths, timeout=300)
            time.sleep(3.0)  # > the guest's 1 s journal commit (data=ordered, commit=1)
        # The file exists only in the guest so far: the host workspace has not got it.
        assert not (paths.workspace / "partial.txt").exists()
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        sock.unlink(missing_ok=True)
        vms = list((settings.data_dir / "microvm").iterdir())
        assert vms, "the VM dir should outlive the launcher"

        second = Served(env, sock)  # reconciles before it listens
        with LauncherClient(sock) as client:
            info = client.get("restart-vm")
            # Live restore: the VM's monitor held it; the new launcher re-adopted it.
            assert info.status == "running", info
            client.cancel("restart-vm")
            info = client.wait("restart-vm", timeout=300)
            assert info.status == "cancelled", info
            res = client.result("restart-vm")
        assert "re-adopted by launcher pid" in (paths.log_dir / "launcher.log").read_text()
        assert _git(repo, "show", f"{res.branch}:partial.txt") == (
            "written before the launcher died\n"
        )
        assert not [d for d in (settings.data_dir / "microvm").iterdir() if d in vms]
        me = os.getpid()
        # the second launcher's own children (its front end) are its, not left over
        theirs = {p.pid for p in psutil.Process(second.proc.pid).children(recursive=True)}
        left = [
            p.info["cmdline"]
            for p in psutil.process_iter(["cmdline", "pid"])
            if p.info["pid"] not in (me, second.proc.pid, *theirs)
            and base in " ".join(p.info["cmdline"] or ())
        ]
        assert left == []
    finally:
        if second is not None:
            second.stop()
        first.stop()
