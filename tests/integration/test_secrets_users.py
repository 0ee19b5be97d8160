"""Secrets belong to the user who set them, as real local users see it.

A launcher is served on its unix socket (uvicorn in a thread, peer-checked as served)
on a data dir other users can reach as members of the group ``agentbox``; two users
made here with ``useradd`` run ``agentbox secret`` through it (``setpriv``). User B
cannot list, use or remove user A's secret, cannot name another owner in a raw request,
and cannot read the store's files; root's shared secret is B's to use; no command's
output, no answer and no error carries a value.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.core.paths import private_data_dir
from agentbox.errors import SecretNotFound
from agentbox.launcher import Launcher
from agentbox.launcher._server import bind_socket, build_server, socket_path
from agentbox.secrets import SecretStore, resolve_for_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes users and serves as root")

GROUP = "agentbox"
A_VALUE = "alice-" + secrets.token_hex(12)
B_VALUE = "bob-" + secrets.token_hex(12)
TEAM_VALUE = "team-" + secrets.token_hex(12)

# As a member: a raw PUT naming another owner, and one whose body is not valid.
_RAW = r"""
import json, socket, sys
def call(method, path, body):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    data = json.dumps(body).encode()
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: l\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out.decode(errors="replace")
print(json.dumps([
    call("PUT", "/v1/secrets/A_TOKEN", {"value": sys.argv[2], "owner_uid": int(sys.argv[3])}),
    call("PUT", "/v1/secrets/A_TOKEN", {"value": 12345}),
    call("PUT", "/v1/secrets/A_TOKEN", {"value": sys.argv[2] + "\n", "shared": False}),
    call("PUT", "/v1/secrets/TEAM", {"value": sys.argv[2], "shared": True}),
]))
"""


def _gid() -> int:
    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "-f", "--system", GROUP], check=True)
        return grp.getgrnam(GROUP).gr_gid


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, int]]:
    """Two local users of their own (alice, bob); removed after."""
    names = [f"abxs-{secrets.token_hex(3)}" for _ in range(2)]
    for name in names:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True)  # fmt: skip
    try:
        yield pwd.getpwnam(names[0]).pw_uid, pwd.getpwnam(names[1]).pw_uid
    finally:
        for name in names:
            subprocess.run(["userdel", name], check=False)


@dataclass
class Served:
    settings: Settings
    env: dict[str, str]

    def cli(
        self, uid: int, *args: str, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``agentbox ARGS`` as ``uid`` (a member of the group; root: as itself)."""
        pre = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}",
                                   f"--groups={_gid()}", "--"]  # fmt: skip
        return subprocess.run(
            [*pre, sys.executable, "-m", "agentbox", *args], env=self.env, input=input,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip


@pytest.fixture
def served() -> Iterator[Served]:
    _gid()
    base = Path(tempfile.mkdtemp(prefix="agentbox-secrets-", dir="/var/tmp"))
    base.chmod(0o755)  # every user may reach the data dir's parent: the data dir guards
    (base / "repos").mkdir()
    data = private_data_dir(base / "data")
    settings = Settings(data_dir=data, repos_root=base / "repos")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(data),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_FRONT_END": "off",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    launcher = Launcher(settings, max_tasks=1)
    server = build_server(launcher)
    listener = bind_socket(socket_path(data))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield Served(settings, env)
    finally:
        server.should_exit = True
        thread.join(10)
        launcher.close()
        shutil.rmtree(base, ignore_errors=True)


def _no_value(*outs: subprocess.CompletedProcess[str]) -> None:
    for out in outs:
        for value in (A_VALUE, B_VALUE, TEAM_VALUE):
            assert value not in out.stdout and value not in out.stderr, out.args


def test_a_users_secret_is_theirs_alone(served: Served, users: tuple[int, int]) -> None:
    alice, bob = users
    set_a = served.cli(alice, "secret", "set", "A_TOKEN", input=A_VALUE + "\n")
    assert set_a.returncode == 0, set_a.stderr
    team = served.cli(0, "secret", "set", "TEAM", "--shared", input=TEAM_VALUE)
    assert team.returncode == 0, team.stderr

    ls_a = served.cli(alice, "secret", "ls", "--json")
    assert ls_a.returncode == 0, ls_a.stderr
    seen = {(e["name"], e["owner_uid"], e["shared"]) for e in json.loads(ls_a.stdout)}
    assert seen == {("A_TOKEN", alice, False), ("TEAM", 0, True)}
    ls_b = served.cli(bob, "secret", "ls")
    assert ls_b.returncode == 0, ls_b.stderr
    assert "TEAM" in ls_b.stdout and "A_TOKEN" not in ls_b.stdout

    # bob can neither remove alice's nor share one; alice's is untouched
    rm_b = served.cli(bob, "secret", "rm", "A_TOKEN")
    assert rm_b.returncode != 0 and "not set" in rm_b.stderr
    shared_b = served.cli(bob, "secret", "set", "TEAM", "--shared", input="x")
    assert shared_b.returncode != 0
    all_b = served.cli(bob, "secret", "ls", "--all")
    assert all_b.returncode != 0

    # a task of bob's can use root's shared one, never alice's
    store = SecretStore(served.settings)
    assert resolve_for_task(served.settings, alice, ["Bearer ${secret:A_TOKEN}"]) == {
        "A_TOKEN": A_VALUE
    }
    assert resolve_for_task(served.settings, bob, ["${secret:TEAM}"]) == {"TEAM": TEAM_VALUE}
    with pytest.raises(SecretNotFound):
        resolve_for_task(served.settings, bob, ["Bearer ${secret:A_TOKEN}"])
    # bob's own of the same name is bob's; alice's stays alice's
    set_b = served.cli(bob, "secret", "set", "A_TOKEN", "--from-env", "B_SECRET_VAR")
    assert set_b.returncode != 0  # not in the environment: refused, named
    assert "B_SECRET_VAR" in set_b.stderr
    env_b = subprocess.run(
        ["setpriv", f"--reuid={bob}", f"--regid={bob}", f"--groups={_gid()}", "--",
         sys.executable, "-m", "agentbox", "secret", "set", "A_TOKEN", "--from-env", "BV"],
        env={**served.env, "BV": B_VALUE}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert env_b.returncode == 0, env_b.stderr
    assert store.resolve(["A_TOKEN"], bob) == {"A_TOKEN": B_VALUE}
    assert store.resolve(["A_TOKEN"], alice) == {"A_TOKEN": A_VALUE}

    # the store's files: root's, private; bob reads none of them
    root = served.settings.data_dir / "secrets"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == 0
    for f in root.glob("*.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == 0
    peek = subprocess.run(
        ["setpriv", f"--reuid={bob}", f"--regid={bob}", f"--groups={_gid()}", "--",
         "cat", str(root / f"{alice}.json")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert peek.returncode != 0 and A_VALUE not in peek.stdout

    rm_a = served.cli(alice, "secret", "rm", "A_TOKEN")
    assert rm_a.returncode == 0, rm_a.stderr
    assert store.resolve(["A_TOKEN"], bob) == {"A_TOKEN": B_VALUE}  # bob's is not alice's
    _no_value(set_a, team, ls_a, ls_b, rm_b, shared_b, all_b, set_b, env_b, rm_a)


def test_a_raw_request_cannot_name_an_owner_or_echo_a_value(
    served: Served, users: tuple[int, int]
) -> None:
    alice, bob = users
    served.cli(alice, "secret", "set", "A_TOKEN", input=A_VALUE)
    out = subprocess.run(
        ["setpriv", f"--reuid={bob}", f"--regid={bob}", f"--groups={_gid()}", "--",
         sys.executable, "-c", _RAW, str(socket_path(served.settings.data_dir)), B_VALUE,
         str(alice)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    named, wrong_type, newline, shared = json.loads(out.stdout)
    assert named.startswith("HTTP/1.1 422") and B_VALUE not in named
    assert wrong_type.startswith("HTTP/1.1 422") and "12345" not in wrong_type
    assert newline.startswith("HTTP/1.1 400") and B_VALUE not in newline
    assert shared.startswith("HTTP/1.1 403")
    store = SecretStore(served.settings)
    assert store.resolve(["A_TOKEN"], alice) == {"A_TOKEN": A_VALUE}
    assert [i.name for i in store.list(bob)] == []


# -- a task resolves only its submitter's secrets (the real launcher and sandbox) ----------

_BOXFILE = """\
[[network.rule]]
host = "pypi.corp.example"
inject = { header = "Authorization", value = "Bearer ${secret:A_TOKEN}" }
"""


@pytest.mark.podman
def test_a_task_uses_only_its_submitters_secrets(users: tuple[int, int]) -> None:
    base = Path(tempfile.mkdtemp(prefix="agentbox-secrets-task-", dir="/var/tmp"))
    base.chmod(0o755)  # the repos' owners run git in them: every user may reach them
    try:
        _task_scope(base, users)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _task_scope(tmp_path: Path, users: tuple[int, int]) -> None:
    from agentbox.boxfile import load_boxfile
    from agentbox.launcher import TaskRequest
    from git_helpers import git

    alice, bob = users
    settings = Settings(
        data_dir=tmp_path / "data",
        repos_root=tmp_path / "repos",
        egress_allow_cap=("pypi.corp.example",),
    )
    settings.repos_root.mkdir()
    SecretStore(settings).set("A_TOKEN", A_VALUE, alice)
    (tmp_path / "Boxfile.toml").write_text(_BOXFILE)
    box = load_boxfile(tmp_path / "Boxfile.toml", settings)
    repos = {}
    for who, uid in (("alice", alice), ("bob", bob)):
        path = settings.repos_root / who
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        (path / "README.md").write_text("hello\n")
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", "init")
        subprocess.run(["chown", "-R", f"{uid}:{uid}", str(path)], check=True)
        repos[uid] = path
    with Launcher(settings, max_tasks=1) as la:
        # The caller is what the launcher's socket reads from SO_PEERCRED.
        mine = la.submit(TaskRequest(repo=str(repos[alice]), task="x"), caller=alice, boxfile=box)
        theirs = la.submit(TaskRequest(repo=str(repos[bob]), task="x"), caller=bob, boxfile=box)
        done_a = la.wait(mine.id, timeout=300)
        done_b = la.wait(theirs.id, timeout=300)
    assert done_a.status == "done", (done_a.error, done_a)
    assert done_b.status == "failed", done_b
    assert f"secret A_TOKEN is not set for uid {bob}" in (done_b.error or ""), done_b
    # the value is in no answer and no file the tasks left (the store's own file aside)
    for info in (done_a, done_b):
        assert A_VALUE not in info.model_dump_json()
    store_file = settings.data_dir / "secrets" / f"{alice}.json"
    for path in settings.data_dir.rglob("*"):
        if path.is_file() and not path.is_symlink() and path != store_file:
            assert A_VALUE.encode() not in path.read_bytes(), path
