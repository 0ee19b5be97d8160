"""A plain ``agentbox run`` that loses its terminal or is interrupted three times never
leaves its task ``running`` (issue 13 §2: "three Ctrl-C today leave a task running
forever, and ``show`` displays a ticking spinner for a dead task").

The real CLI runs in its own process on a pseudo-terminal, with the real Claude Code and
a replay model whose agent sleeps in Bash; the terminal is then hung up (SIGHUP, the
master side closed) or sent three SIGINTs, and the task must reach a terminal state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.config import Settings
from git_helpers import git
from task_cleanup import sweep

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

#: The agent sleeps in Bash long enough to be interrupted while it runs (in Python:
#: Claude Code 2.1.332 refuses a plain `sleep 300` in its Bash tool).
SLEEPER = """\
name: sleeper
turns:
  - text: "Sleeping."
    tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(300)'; echo woke"
          description: nap
          timeout: 400000
  - text: "Woke up."
"""

TERMINAL = {"done", "failed", "timed_out", "cancelled"}


@dataclass
class World:
    base: Path
    env: dict[str, str]

    def repo(self, name: str) -> Path:
        path = self.base / "repos" / name
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        (path / "README.md").write_text("hello\n")
        git(path, "add", "-A")
        git(path, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
        return path

    def settings(self) -> Settings:
        return Settings(data_dir=self.base / "data", repos_root=self.base / "repos")


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-converge-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    (base / "sleeper.yaml").write_text(SLEEPER)
    (base / "models.toml").write_text(
        'default = "sleeper"\n[models.sleeper]\nkind = "replay"\nupstream = "sleeper.yaml"\n'
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "TERM": "xterm",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        yield World(base, env)
    finally:
        sweep(base, env)
        shutil.rmtree(base, ignore_errors=True)


def _stop_service(data: Path) -> None:
    """Stop a launcher service a command started on demand (its pid from the lock file)."""
    from agentbox.launcher._store import Owner

    try:
        pid = int((data / "run" / "launcher.lock").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    owner = Owner.of(pid)
    if owner is not None and owner.alive():
        os.kill(owner.pid, signal.SIGTERM)
        end = time.monotonic() + 120
        while owner.alive() and time.monotonic() < end:
            time.sleep(0.2)


def _status(world: World, task_id: str) -> str:
    from agentbox.launcher._store import Store

    return Store(world.base / "data" / "state.db").get(task_id).status


def _start_on_a_tty(world: World, task_id: str) -> tuple[subprocess.Popen[bytes], int]:
    repo = world.repo(task_id)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "run", "--repo", str(repo), "--id", task_id,
         "--deadline", "600", "Sleep a while."],
        env=world.env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=_take_terminal,
    )  # fmt: skip
    os.close(slave)
    # Drain the terminal so the CLI never blocks on a full pty buffer.
    end = time.monotonic() + 300
    seen = b""
    while True:
        with contextlib.suppress(OSError):
            if select.select([master], [], [], 0)[0]:
                seen = (seen + os.read(master, 65536))[-4000:]
        try:
            if "agent running" in _phase(world, task_id) or "running claude" in _phase(
                world, task_id
            ):
                break
        except Exception:
            pass
        assert proc.poll() is None, f"run ended early: rc {proc.returncode}: {seen!r}"
        assert time.monotonic() < end, "the agent never started"
        time.sleep(0.3)
    # Claude Code is in its Bash call (the nap): its tool call is in the agent's log.
    log = world.base / "data" / "tasks" / task_id / "logs" / "agent.jsonl"
    while "time.sleep(300)" not in (log.read_text() if log.exists() else ""):
        with contextlib.suppress(OSError):
            if select.select([master], [], [], 0)[0]:
                seen = (seen + os.read(master, 65536))[-4000:]
        assert proc.poll() is None, f"run ended early: rc {proc.returncode}: {seen!r}"
        assert time.monotonic() < end, "the agent never ran its Bash call"
        time.sleep(0.3)
    time.sleep(1)
    return proc, master


def _take_terminal() -> None:
    # The pty becomes the controlling terminal of run's session, as in a real shell:
    # a hang-up then sends SIGHUP to the session, Ctrl-C SIGINT to its process group.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # A shell's Ctrl-C reaches a foreground job whose INT is not ignored; a suite started
    # in the background (a non-interactive `cmd &`, as a CI runner may) ignores INT, and
    # an ignored signal stays ignored across exec: restore what a terminal gives.
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _phase(world: World, task_id: str) -> str:
    from agentbox.launcher._store import Store

    row = Store(world.base / "data" / "state.db").get(task_id)
    return f"{row.status} {row.phase}"


def _converges(world: World, task_id: str, proc: subprocess.Popen[bytes]) -> str:
    try:
        proc.wait(240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("run did not end within 240 s of its interruption") from None
    end = time.monotonic() + 240
    status = _status(world, task_id)
    while status not in TERMINAL and time.monotonic() < end:
        time.sleep(1)
        status = _status(world, task_id)
    return status


def _no_sandbox(task_id: str) -> None:
    """No sandbox of the task, once its removal (off the task's path) has had 30 s."""
    end = time.monotonic() + 30
    while True:
        res = subprocess.run(
            ["podman", "ps", "-a", "--format", "{{.Names}}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        if f"agentbox-task-{task_id}" not in res.stdout.split() or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert f"agentbox-task-{task_id}" not in res.stdout.split()


def test_a_hung_up_terminal_leaves_no_running_task(world: World) -> None:
    proc, master = _start_on_a_tty(world, "hup")
    os.close(master)  # the terminal goes away: the kernel hangs up run's session
    status = _converges(world, "hup", proc)
    assert status in TERMINAL, f"task still {status} after its terminal went away"
    _no_sandbox("hup")


def test_three_ctrl_c_leave_no_running_task(world: World) -> None:
    proc, master = _start_on_a_tty(world, "intx3")
    try:
        for _ in range(3):
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
            time.sleep(0.5)
        status = _converges(world, "intx3", proc)
    finally:
        os.close(master)
    assert status in TERMINAL, f"task still {status} after three Ctrl-C"
    _no_sandbox("intx3")


def test_a_killed_run_is_taken_over_when_looked_at(world: World) -> None:
    """``run`` killed outright (SIGKILL: no handler runs): ``show`` must not draw a task
    nothing runs as if it were moving (the spinner it printed before), but hand it to the
    launcher service, started on demand, which re-adopts or settles it; ``cancel`` then
    stops it and ``wait`` sees it end."""
    proc, master = _start_on_a_tty(world, "killed")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        os.close(master)
    try:
        show = subprocess.run(
            [sys.executable, "-m", "agentbox", "show", "killed"],
            env=world.env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert not re.search("[\u2800-\u28ff]", show.stdout), show.stdout  # no spinner
        assert "launcher (pid" in show.stderr and "is gone" in show.stderr, show.stderr
        from agentbox.launcher._store import Store

        row = Store(world.base / "data" / "state.db").get("killed")
        assert row.info().terminal or (row.owner is not None and row.owner.alive()), row
        subprocess.run(
            [sys.executable, "-m", "agentbox", "cancel", "killed"],
            env=world.env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        waited = subprocess.run(
            [sys.executable, "-m", "agentbox", "wait", "killed", "--timeout", "300", "--json"],
            env=world.env, capture_output=True, text=True, timeout=400, check=False,
        )  # fmt: skip
        assert waited.returncode in (1, 5, 6), (waited.returncode, waited.stdout, waited.stderr)
        doc = json.loads(waited.stdout)
        assert doc["tasks"][0]["status"] in TERMINAL
        _no_sandbox("killed")
    finally:
        _stop_service(world.base / "data")
