"""The Python SDK (issue 29 §1, §2) against a real launcher, as a real non-root user.

The launcher (``agentbox launcher serve``) runs as root in a child process on a private
data dir; the SDK runs in processes of uids that are members of the group ``agentbox``
(``setpriv``), with the world-readable interpreter ``scripts/setup.sh`` installs for
them (``/opt/agentbox/venv``: root's project venv may sit in a 0700 home). The script
they run is ``sdk_client.py`` next to this file; it prints the facts it saw as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_launcher_auth import Stack, _group_gid, stop, wait_listening

from gateway_helpers import greet_script

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="runs the launcher as root"),
    pytest.mark.podman,
]

#: Two ordinary members of the group agentbox (bare uids: nothing to clean up).
UID_A, UID_B = 64331, 64332
VENV_PYTHON = Path("/opt/agentbox/venv/bin/python")
CLIENT = Path(__file__).with_name("sdk_client.py")


@pytest.fixture
def stack() -> Iterator[Stack]:
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/setup.sh (it installs it)")
    _group_gid()
    base = Path(tempfile.mkdtemp(prefix="agentbox-sdk-"))
    base.chmod(0o755)
    repos = base / "repos"
    repos.mkdir()
    (base / "quick.yaml").write_text(greet_script("quick"))
    (base / "models.toml").write_text('[models.quick]\nkind = "replay"\nupstream = "quick.yaml"\n')
    shutil.copy(CLIENT, base / "sdk_client.py")
    for uid in (UID_A, UID_B):
        home = base / f"home-{uid}"
        home.mkdir(mode=0o700)
        os.chown(home, uid, uid)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(repos),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "AGENTBOX_POOL_SIZE": "1",  # the SDK's warm spare
    }
    try:
        yield Stack(base, base / "data", repos, env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def launcher(stack: Stack) -> Iterator[subprocess.Popen[str]]:
    proc = stack.start()
    try:
        wait_listening(stack, proc)
        yield proc
    finally:
        stop(proc)


def as_user(stack: Stack, uid: int, *args: str, **popen: Any) -> list[str]:
    """argv running sdk_client.py as ``uid`` (a member of agentbox) with /opt's python."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={_group_gid()}", "--",
            str(VENV_PYTHON), str(stack.base / "sdk_client.py"), *args]  # fmt: skip


def user_env(stack: Stack, uid: int) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(stack.base / f"home-{uid}"),
        "TMPDIR": str(stack.base / f"home-{uid}"),
        "AGENTBOX_LAUNCHER_SOCKET": str(stack.link),
        "AGENTBOX_REPOS_ROOT": str(stack.repos),
    }


def run_as(stack: Stack, uid: int, *args: str, timeout: float = 900) -> dict[str, Any]:
    out = subprocess.run(as_user(stack, uid, *args), env=user_env(stack, uid),
                         capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def hold(stack: Stack, uid: int) -> tuple[subprocess.Popen[str], str, str]:
    """A process of ``uid`` holding a fresh sandbox; (the process, the sandbox id, its
    container's id prefix)."""
    proc = subprocess.Popen(as_user(stack, uid, "hold"), env=user_env(stack, uid),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(60)
        raise AssertionError(proc.stderr.read() if proc.stderr else "no output")
    said = json.loads(line)
    return proc, said["id"], said["container"]


def release(proc: subprocess.Popen[str]) -> None:
    """Close its stdin (a holder then exits and its sandbox goes) and reap it."""
    with proc:  # closes the pipes
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(120)


def root_ids(stack: Stack) -> set[str]:
    from agentbox.launcher import LauncherClient

    with LauncherClient(stack.link) as c:
        return {i.id for i in c.sandbox_list()}


def test_the_interpreter_group_members_run_is_world_readable() -> None:
    """What setup installs for members of agentbox: a system-python venv nobody's home
    hides, and ``agentbox`` on PATH running it."""
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/setup.sh")
    real = Path(os.path.realpath(VENV_PYTHON))
    assert not str(real).startswith("/root/"), real
    out = subprocess.run(
        ["setpriv", f"--reuid={UID_A}", f"--regid={UID_A}", f"--groups={_group_gid()}", "--",
         "/usr/local/bin/agentbox", "--version"],
        capture_output=True, text=True, timeout=120, check=False, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert out.returncode == 0 and "agentbox" in out.stdout, out.stderr


def test_sync_sandbox_as_a_member(stack: Stack, launcher: subprocess.Popen[str]) -> None:
    """Output and exit codes, streaming, background kill, files, trees both ways, links."""
    got = run_as(stack, UID_A, "sync")
    assert got["uid"] == UID_A
    assert got["warm"] is True  # the first command below ran in the spare's primed exec
    assert got["run"] == [3, "42\n", "oops\n"]
    assert got["argv"] == "a b|c|"
    assert got["stream"] == ["a\nb\n", 0]  # "b" only once the client saw "a" mid-command
    assert got["killed"] == [137, False] and got["sleeps_left"] == "0"
    assert got["read"] == "print(1)\n"
    assert got["list"] == [["a.py", "file", 9]]
    assert got["roundtrip"] == ["X = 1\n", True]
    # The sandbox's links: kept as links (never followed) or dropped; nothing leaked.
    assert got["evil"].get("f") == "file"
    assert all(kind == "link" for name, kind in got["evil"].items() if name != "f"), got["evil"]
    assert "abs" not in got["evil"] and "root" not in got["evil"]  # pointing out: dropped
    assert got["evil_inside_target"] == "f"
    assert got["evil_leaked"] is False
    assert got["trap"] == "refused: PathRefused" and got["victim"] == []
    assert got["listed"] is True and got["gone_after_with"] is True
    assert root_ids(stack) == set()


def test_async_sandbox_as_a_member(stack: Stack, launcher: subprocess.Popen[str]) -> None:
    got = run_as(stack, UID_A, "async")
    assert got["run"] == [4, "hi\n"]
    assert got["stream"] == ["a\nb\n", 0]
    assert got["killed"] == 137
    assert got["read"] == "async\n" and "x.txt" in got["list"]
    assert got["download"] == "async\n"
    # Sandbox.fork(2): two sandboxes of A's with their own deadlines, each starting from
    # the parent's files (workspace and tmpfs); a write in one is in neither the other
    # nor the parent.
    assert got["fork_ids"] == 3 and got["fork_uids"] == [UID_A, UID_A], got
    assert all(290 <= d <= 300 for d in got["fork_deadlines"]), got
    assert got["fork_parent_deadline"] > 500, got
    assert got["fork_seen"] == [["async\n", "tmpfs\n"]] * 2, got
    assert got["fork_write"] == 0, got
    assert got["fork_after"] == {"f1": "async\none\n", "f2": "async\n", "parent": "async\n",
                                 "f2_only1": 1, "parent_only1": 1}, got  # fmt: skip
    assert got["fork_listed"] is True and got["forks_gone"] is True, got
    assert got["gone_after_with"] is True


def test_another_users_sandbox_is_unreachable(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """B neither lists nor reaches A's sandbox, by any route; A's stays alive."""
    proc, sid, _ = hold(stack, UID_A)
    try:
        got = run_as(stack, UID_B, "other", sid)
        assert got == {"listed": False, "connect": "gone", "get": "gone", "exec": "gone",
                       "read": "gone", "write": "gone", "download": "gone",
                       "remove": "gone"}, got  # fmt: skip
        assert sid in root_ids(stack)
        # Its owner reaches it from another process (Sandbox.connect), which holds it too.
        mine = run_as(stack, UID_A, "connect", sid)
        assert mine == {"out": "42\n", "holders": 2, "alive_after_with": True}, mine
    finally:
        release(proc)


def test_a_killed_clients_sandbox_is_reaped(stack: Stack, launcher: subprocess.Popen[str]) -> None:
    """The launcher holds a pidfd on the process that created the sandbox: SIGKILL it, and
    the sandbox (its container too) is removed."""
    proc, sid, container = hold(stack, UID_A)
    assert sid in root_ids(stack)
    assert _exists(container), "no podman container for the held sandbox"
    os.kill(proc.pid, signal.SIGKILL)
    release(proc)
    end = time.monotonic() + 120
    while sid in root_ids(stack):
        assert time.monotonic() < end, "the sandbox of a killed client was not reaped"
        time.sleep(0.5)
    end = time.monotonic() + 120
    while _exists(container):
        assert time.monotonic() < end, "the reaped sandbox's container is still there"
        time.sleep(0.5)


def _exists(container: str) -> bool:
    out = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"id={container}"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return bool(out.stdout.strip())


@pytest.mark.claude
def test_a_task_from_python_as_a_member(stack: Stack, launcher: subprocess.Popen[str]) -> None:
    """Client.tasks with the scripted replay model (offline): done, with a branch."""
    repo = stack.repo_of(UID_A, "proj")
    got = run_as(stack, UID_A, "task", str(repo))
    assert got["status"] == "done", got
    assert got["branch"].startswith("agentbox/"), got
    assert got["diff_has_greet"] and got["events"] > 0
    assert got["listed"] and got["get"] == "done"
    assert got["kept_branch"] == "" and got["published_branch"] == f"agentbox/{got['published_id']}"
