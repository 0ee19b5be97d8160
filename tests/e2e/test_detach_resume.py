"""``run --detach``, ``wait``, ``watch``, ``diff``, ``apply`` and ``resume`` with the real
Claude Code on podman (issue 13 §2), each command its own process as a user runs it.

* ``run --detach`` starts the launcher service on demand, prints ``{"id": …}`` and exits;
  ``wait`` exits 0 once the task is done; ``diff`` (piped: git's text) and ``--stat``;
  ``apply`` refuses a dirty tree (keeping the user's edit), then fast-forwards ``main``.
* ``resume`` continues that task: the replay model's answers depend on what it
  received. Claude Code resumed the first task's session (``--resume``), so the first
  request already carries its two assistant messages and is answered by turn 2; the
  task text names the previous-task file; the file, read with Bash, holds the first
  task's last message. Only then is the final message ``SAW-PREVIOUS``. The new branch
  stacks on the first one.
* ``wait`` rides through a launcher killed and restarted under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbox.launcher._store import Owner
from gateway_helpers import greet_script
from git_helpers import git
from task_cleanup import sweep

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

#: The follow-up's agent: it reads the previous-task file only if its task text names it,
#: and writes farewell.py only if that file holds the first task's last message.
SECOND = """\
name: second
main: tools
side_reply: "Follow up"
turns:
  # Turns 0 and 1 answer only a fresh session: a resumed one carries the first task's two
  # assistant messages, so its first request is answered by turn 2.
  - text: "NOT-RESUMED"
  - text: "NOT-RESUMED"
  - branches:
      - match: "previous-task\\\\.md"
        text: "Reading what the previous task did."
        tool_use:
          - name: Bash
            input: {command: "cat {{cwd}}/.git/agentbox/previous-task.md", description: "read"}
      - text: "NO-FILE-NAMED"
  - branches:
      - match: "Added greet\\\\(\\\\) in greet\\\\.py"
        text: "Adding farewell() next to greet()."
        tool_use:
          - name: Write
            input:
              file_path: "{{cwd}}/farewell.py"
              content: "def farewell(name):\\n    return 'bye ' + name\\n"
      - text: "NO-PREVIOUS-TRANSCRIPT"
  - text: "SAW-PREVIOUS: resumed the session; farewell() added next to greet()."
"""

SLEEPER = """\
name: sleeper
turns:
  - text: "Sleeping."
    tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(20)'; echo woke"
          description: nap
          timeout: 60000
  - text: "Woke up."
"""


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

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentbox", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def service(self) -> Owner | None:
        try:
            pid = int((self.base / "data" / "run" / "launcher.lock").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        owner = Owner.of(pid)
        return owner if owner is not None and owner.alive() else None


def _stop(owner: Owner | None, sig: int = signal.SIGTERM) -> None:
    if owner is None or not owner.alive():
        return
    os.kill(owner.pid, sig)
    end = time.monotonic() + 120
    while owner.alive() and time.monotonic() < end:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-detach-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    (base / "first.yaml").write_text(greet_script("first"))
    (base / "second.yaml").write_text(SECOND)
    (base / "sleeper.yaml").write_text(SLEEPER)
    (base / "models.toml").write_text(
        'default = "first"\n'
        + "".join(
            f'[models.{n}]\nkind = "replay"\nupstream = "{n}.yaml"\n'
            for n in ("first", "second", "sleeper")
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "COLUMNS": "100",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    w = World(base, env)
    try:
        yield w
    finally:
        sweep(base, env)
        shutil.rmtree(base, ignore_errors=True)


def _json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (rc {r.returncode}):\n{r.stdout}\n{r.stderr}") from None
    assert isinstance(doc, dict)
    return doc


def test_detach_wait_diff_apply_then_resume(world: World) -> None:
    repo = world.repo("detached")
    # run --detach: the service is started on demand, the id printed, the command ends.
    r = world.cli("run", "--detach", "--json", "--repo", str(repo), "Add a greet(name) function")
    assert r.returncode == 0, (r.stdout, r.stderr)
    first = _json(r)["id"]
    assert world.service() is not None, "no launcher service is running"
    w = world.cli("wait", first, "--json")
    assert w.returncode == 0, (w.stdout, w.stderr)
    assert _json(w)["tasks"][0]["status"] == "done"

    d = world.cli("diff", first)
    assert d.returncode == 0 and "+def greet(name):" in d.stdout, d
    assert "\x1b[" not in d.stdout  # piped: no colors
    s = world.cli("diff", first, "--stat")
    assert "greet.py | +2 -0" in s.stdout, s.stdout

    # apply refuses a dirty tree and leaves the user's edit as it was …
    (repo / "README.md").write_text("my own edit\n")
    a = world.cli("apply", first)
    assert a.returncode == 3 and "uncommitted changes" in a.stderr, (a.stdout, a.stderr)
    assert (repo / "README.md").read_text() == "my own edit\n"
    assert not (repo / "greet.py").exists()
    git(repo, "checkout", "--", "README.md")
    # … and on a clean tree fast-forwards main to the task's commit.
    a = world.cli("apply", first)
    assert a.returncode == 0, (a.stdout, a.stderr)
    assert "fast-forward" in a.stdout
    assert git(repo, "rev-parse", "main") == git(repo, "rev-parse", f"agentbox/{first}")
    assert git(repo, "status", "--porcelain") == ""
    assert (repo / "greet.py").read_text().startswith("def greet(name):")

    # resume: a new task on the first one's branch, told what it did.
    r = world.cli("resume", first, "--detach", "--json", "--model", "second", "Add farewell")
    assert r.returncode == 0, (r.stdout, r.stderr)
    second = _json(r)["id"]
    watched = world.cli("watch", second)
    assert watched.returncode == 0, (watched.stdout[-3000:], watched.stderr[-3000:])
    assert "SAW-PREVIOUS" in watched.stdout, watched.stdout[-3000:]
    assert "Bash" in watched.stderr  # the events, one line each, while it ran
    show = _json(world.cli("show", second, "--json"))
    assert show["result"]["report"]["final_message"].startswith("SAW-PREVIOUS")
    # Claude Code resumed the first task's own session (its --resume, offline).
    assert _session_of(world, second) == _session_of(world, first) != ""
    # The new branch stacks on the first: its parent is the first task's commit, and
    # the previous-task file (in the agent's own .git) is not part of the result.
    assert git(repo, "rev-parse", f"agentbox/{second}~1") == git(
        repo, "rev-parse", f"agentbox/{first}"
    )
    names = git(repo, "diff", "--name-only", f"agentbox/{first}", f"agentbox/{second}")
    assert names.split() == ["farewell.py"], names


def _session_of(world: World, task_id: str) -> str:
    log = world.base / "data" / "tasks" / task_id / "logs" / "agent.jsonl"
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if isinstance(ev, dict) and ev.get("type") == "system":
                return str(ev.get("session_id", ""))
    return ""


def test_resume_refuses_a_task_of_another_repo_or_unfinished(world: World) -> None:
    r = world.cli("resume", "no-such-task", "Go on")
    assert r.returncode != 0 and "no-such-task" in (r.stdout + r.stderr)


def test_wait_rides_through_a_launcher_restart(world: World) -> None:
    repo = world.repo("restart")
    r = world.cli("run", "--detach", "--json", "--model", "sleeper", "--repo", str(repo), "Nap")
    assert r.returncode == 0, (r.stdout, r.stderr)
    tid = _json(r)["id"]
    waiter = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "wait", tid],
        env=world.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert waiter.stderr is not None
        said = waiter.stderr.readline()  # it has read the task from the launcher once
        assert f"waiting for {tid}" in said, said
        _stop(world.service(), signal.SIGKILL)  # the launcher dies under the waiter …
        time.sleep(3)
        assert waiter.poll() is None, waiter.communicate()
        serve = subprocess.Popen(  # … and a new one starts (reconciling the task)
            [sys.executable, "-m", "agentbox", "launcher", "serve"],
            env=world.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        out, err = waiter.communicate(timeout=300)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert "launcher restarting" in err, err
    assert "started the launcher service" not in err, err  # the restart was ours, not its
    assert waiter.returncode in (0, 1, 5, 6), (waiter.returncode, out, err)
    assert tid in out
    _stop(Owner.of(serve.pid))
    serve.wait(30)
