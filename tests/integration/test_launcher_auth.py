"""Who may talk to the launcher, and what each caller may see (issue 11, items 1 and 2).

Everything here runs the real ``agentbox launcher serve`` (and ``agentbox serve``)
as root in a child process and talks to it over its real unix socket from
processes that run as other uids (``setpriv``): two ordinary members of the
group ``agentbox`` (A and B), an outsider not in it (X), and root.

* the socket lives in a directory that is ``root:agentbox 0750``; an outsider
  cannot reach it, and even with the file modes opened wide it gets no HTTP byte
  back: the launcher checks ``SO_PEERCRED`` before it reads the request;
* a second ``launcher serve`` on the same data dir refuses to start and leaves
  the live socket alone;
* ``agentbox serve`` says "serving" only once its HTTP port answers, and fails
  (without saying it) when the port is taken;
* a non-root caller lists, reads and cancels only the tasks it submitted; root
  sees and cancels all (the podman + Claude Code test runs real tasks).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway_helpers import greet_script
from git_helpers import git
from net_helpers import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the launcher as root")

#: Two ordinary users in the group ``agentbox``, and one outsider. Bare uids: nothing to clean up.
UID_A, UID_B, UID_X = 64311, 64312, 64313
GROUP = "agentbox"

SLOW = """\
name: slow
main: tools
side_reply: "Wait"
turns:
  - text: "Thinking for a long time."
    delay: 300
"""

# A client run as another uid: one raw HTTP/1.1 request over the unix socket, the outcome as JSON.
_CLIENT = r"""
import json, socket, sys
path, method, url, body = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode()
out = {"uid": __import__("os").getuid()}
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
try:
    s.connect(path)
except OSError as exc:
    out["connect_errno"] = exc.errno
    print(json.dumps(out)); sys.exit(0)
head = (f"{method} {url} HTTP/1.1\r\nHost: launcher\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
reply = b""
try:
    s.sendall(head + body)
    while chunk := s.recv(65536):
        reply += chunk
except OSError as exc:
    out["io_errno"] = exc.errno
out["reply_bytes"] = len(reply)
if reply:
    status_line, _, rest = reply.partition(b"\r\n")
    out["status"] = int(status_line.split()[1])
    out["body"] = rest.partition(b"\r\n\r\n")[2].decode(errors="replace")
print(json.dumps(out))
"""


def _group_gid() -> int:
    """The documented install step (``groupadd --system agentbox``); left in place: other
    tests and the host's own launcher use it."""
    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "-f", "--system", GROUP], check=True)
        return grp.getgrnam(GROUP).gr_gid


@dataclass
class Reply:
    """What one request as some uid got back."""

    raw: dict[str, Any]

    @property
    def status(self) -> int | None:
        return self.raw.get("status")

    def json(self) -> Any:
        return json.loads(self.raw["body"])


def call_as(
    uid: int, sock: Path | str, method: str, url: str, body: dict[str, Any] | None = None
) -> Reply:
    """One request to the launcher as ``uid`` (0: root; A/B: members of ``agentbox``; X: not)."""
    argv = [sys.executable, "-c", _CLIENT, str(sock), method, url, json.dumps(body) if body else ""]
    if uid != 0:
        groups = f"--groups={_group_gid()}" if uid in (UID_A, UID_B) else "--clear-groups"
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", groups, "--", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return Reply(json.loads(out.stdout))


_LIST_AS_CLIENT = r"""
import sys
from agentbox.errors import TaskError
from agentbox.launcher import LauncherClient
try:
    print(len(LauncherClient(sys.argv[1]).list()))
except TaskError as exc:
    print(exc)
"""


def client_list_as(uid: int, sock: Path) -> str:
    """What :class:`LauncherClient` says to an outsider ``uid`` (X) asking for the list."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
            sys.executable, "-c", _LIST_AS_CLIENT, str(sock)]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


@dataclass
class Stack:
    base: Path
    data: Path
    repos: Path
    env: dict[str, str]

    @property
    def link(self) -> Path:
        """The path clients use."""
        return self.data / "launcher.sock"

    def real_socket(self) -> Path:
        return Path(os.path.realpath(self.link))

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def repo_of(self, uid: int, name: str) -> Path:
        path = self.repos / name
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        (path / "README.md").write_text("hello\n")
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", "init")
        subprocess.run(["chown", "-R", "-h", f"{uid}:{uid}", str(path)], check=True)
        return path


def wait_listening(st: Stack, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    """Until root can connect to the launcher (the path may be a stale one until then)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited {proc.returncode}: {_stderr(proc)}")
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(st.link))
            except OSError:
                time.sleep(0.1)
            else:
                return
    raise AssertionError("the launcher did not listen")


def _stderr(proc: subprocess.Popen[str]) -> str:
    return proc.stderr.read() if proc.stderr else ""


def stop(proc: subprocess.Popen[str]) -> None:
    with proc:  # closes its pipes
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def stack() -> Iterator[Stack]:
    _group_gid()
    base = Path(tempfile.mkdtemp(prefix="agentbox-auth-"))
    base.chmod(0o755)  # the other uids must reach the data dir (the run dir is what guards)
    repos = base / "repos"
    repos.mkdir()
    (base / "slow.yaml").write_text(SLOW)
    (base / "quick.yaml").write_text(greet_script("quick"))
    (base / "models.toml").write_text(
        '[models.slow]\nkind = "replay"\nupstream = "slow.yaml"\n\n'
        '[models.quick]\nkind = "replay"\nupstream = "quick.yaml"\n'
    )
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(repos),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
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


# -- item 1: the socket ------------------------------------------------------------------


def test_socket_sits_in_a_root_agentbox_0750_dir(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """Members reach it, outsiders cannot even get to the path."""
    real = stack.real_socket()
    st, dst = real.lstat(), real.parent.lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert (st.st_uid, st.st_gid) == (0, _group_gid())
    assert real.parent != stack.data, "the socket must sit in its own directory"
    assert stat.S_IMODE(dst.st_mode) == 0o750 and (dst.st_uid, dst.st_gid) == (0, _group_gid())
    assert call_as(UID_A, stack.link, "GET", "/v1/tasks").status == 200
    out = call_as(UID_X, stack.link, "GET", "/v1/tasks").raw
    assert out.get("connect_errno") == 13, out  # EACCES: the directory is closed to it
    assert "members of the group agentbox" in client_list_as(UID_X, stack.link)


def test_peer_check_closes_an_outsider_before_any_http(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """With every file mode opened wide (the start-up window of old), an outsider still gets
    no HTTP byte back: SO_PEERCRED is checked on accept. A member still gets answers."""
    real = stack.real_socket()
    stack.data.chmod(0o755)  # the data dir is closed to outsiders too (issue 33 §3)
    real.parent.chmod(0o777)
    real.chmod(0o666)
    out = call_as(UID_X, stack.link, "GET", "/v1/tasks").raw
    assert "connect_errno" not in out, out  # the file modes let it connect...
    assert out["reply_bytes"] == 0, out  # ...but the launcher closed it without a word
    body = {"repo": str(stack.repos / "nope"), "task": "x"}
    out = call_as(UID_X, stack.link, "POST", "/v1/tasks", body).raw
    assert out["reply_bytes"] == 0, out
    assert "members of the group agentbox" in client_list_as(UID_X, stack.link)
    assert call_as(UID_B, stack.link, "GET", "/v1/tasks").status == 200
    assert call_as(0, stack.link, "GET", "/v1/models").status == 200


def test_a_second_launcher_refuses_and_leaves_the_live_socket(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    real = stack.real_socket()
    ino = real.lstat().st_ino
    second = stack.start()
    try:
        try:
            code = second.wait(90)
        except subprocess.TimeoutExpired:
            code = None
        err = _stderr(second) if code is not None else ""
    finally:
        stop(second)
    assert code not in (None, 0), "a second launcher started on a data dir that has one"
    assert "already" in err and str(launcher.pid) in err, err
    assert "listening" not in err, err  # a refused launcher announces no socket
    assert stack.real_socket().lstat().st_ino == ino  # never unlinked, never replaced
    assert launcher.poll() is None
    assert call_as(0, stack.link, "GET", "/v1/tasks").status == 200


def test_a_stale_socket_is_replaced(stack: Stack) -> None:
    """A socket nobody listens on (a launcher that was killed) does not block a new one."""
    first = stack.start()
    try:
        wait_listening(stack, first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no clean-up: the socket file stays
        stop(first)  # reaps it and closes its pipe
    assert stack.real_socket().exists()
    second = stack.start()
    try:
        wait_listening(stack, second)
        assert call_as(UID_A, stack.link, "GET", "/v1/tasks").status == 200
    finally:
        stop(second)
    assert not stack.real_socket().exists() and not stack.link.exists()


def _serve(stack: Stack, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbox", "serve", "--http", f"127.0.0.1:{port}",
         "--user", str(UID_A)],
        env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_agentbox_serve_fails_without_serving_when_the_port_is_taken(stack: Stack) -> None:
    stack.repos.chmod(0o755)
    os.chown(stack.repos, UID_A, UID_A)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(stack, port)
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            stop(proc)
    assert proc.returncode != 0
    assert "serving" not in out, out
    assert f"127.0.0.1:{port}" in err, err
    assert not stack.link.exists()  # the launcher it started was stopped again


def test_agentbox_serve_refuses_while_a_launcher_serves_the_data_dir(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """Its own launcher cannot start (the lock): no "serving", and the running one is untouched."""
    from agentbox.launcher._server import LOCK_NAME, RUN_DIR
    from agentbox.mcp._run import LAUNCHER_LOCK

    assert Path(RUN_DIR) / LOCK_NAME == LAUNCHER_LOCK
    stack.repos.chmod(0o755)
    os.chown(stack.repos, UID_A, UID_A)
    proc = _serve(stack, free_port())
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        stop(proc)
    assert proc.returncode != 0
    assert "serving" not in out, out
    assert "already serving this data dir" in err, err
    assert launcher.poll() is None
    assert call_as(0, stack.link, "GET", "/v1/tasks").status == 200


def test_agentbox_serve_answers_when_it_says_serving(stack: Stack) -> None:
    stack.repos.chmod(0o755)
    os.chown(stack.repos, UID_A, UID_A)
    port = free_port()
    proc = _serve(stack, port)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert any("serving" in x for x in lines), (lines, proc.poll())
        # Said "serving": the MCP endpoint answers HTTP right now (401: no bearer token).
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(f"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert s.recv(64).startswith(b"HTTP/1.1 401")
    finally:
        stop(proc)


# -- item 2: each caller sees its own tasks ----------------------------------------------


def _insert(db: Path, task_id: str, status: str, uid: int | None) -> None:
    """A task row as if ``uid`` had submitted it (on a store without ``caller_uid``, as
    versions before it wrote it: then the test runs, and fails, against those too)."""
    with sqlite3.connect(db) as con:
        cols = {r[1] for r in con.execute("PRAGMA table_info(tasks)")}
        extra = ("caller_uid",) if "caller_uid" in cols else ()
        names = ", ".join(("id", "status", "repo", "task", "model", "budget", "deadline",
                           "created_at", *extra))  # fmt: skip
        values = (task_id, status, "/r", "x", "replay-demo", 5, 10.0, time.time(), uid)
        values = values[: len(values) - 1 + len(extra)]
        marks = ", ".join("?" for _ in values)
        con.execute(f"INSERT INTO tasks ({names}) VALUES ({marks})", values)


def test_callers_see_only_their_tasks_root_sees_all(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """Rows of A, of B, and one from before uids were recorded (only root sees that one)."""
    db = stack.data / "state.db"
    _insert(db, "task-a", "done", UID_A)
    _insert(db, "task-b", "running", UID_B)
    _insert(db, "task-old", "done", None)
    seen = {
        uid: {t["id"] for t in call_as(uid, stack.link, "GET", "/v1/tasks").json()["tasks"]}
        for uid in (UID_A, UID_B, 0)
    }
    assert seen == {UID_A: {"task-a"}, UID_B: {"task-b"}, 0: {"task-a", "task-b", "task-old"}}
    for path in ("/v1/tasks/task-a", "/v1/tasks/task-a/result", "/v1/tasks/task-old"):
        r = call_as(UID_B, stack.link, "GET", path)
        assert r.status == 404 and r.json()["error"] == "TaskNotFound", r.raw
        assert call_as(0, stack.link, "GET", path).status == 200
    r = call_as(UID_A, stack.link, "POST", "/v1/tasks/task-b/cancel")
    assert r.status == 404, r.raw
    assert call_as(0, stack.link, "GET", "/v1/tasks/task-b").json()["status"] == "running"
    mine = call_as(UID_A, stack.link, "GET", "/v1/tasks/task-a").json()
    assert mine["uid"] == UID_A


@pytest.mark.podman
@pytest.mark.claude
def test_two_users_and_root_with_real_tasks(stack: Stack) -> None:
    """Real tasks submitted over the socket by A and B (one runs, one waits its turn): neither
    sees, reads or cancels the other's; a member cannot delegate a repo it does not own;
    root sees both and cancels A's running task, whose result A can then read."""
    proc = stack.start("--max-tasks", "1")
    try:
        wait_listening(stack, proc)
        repo_a, repo_b = stack.repo_of(UID_A, "a"), stack.repo_of(UID_B, "b")
        slow = {"task": "wait", "model": "slow", "publish": False}
        ra = call_as(UID_A, stack.link, "POST", "/v1/tasks", {"repo": str(repo_a), **slow})
        assert ra.status == 201, ra.raw
        a = ra.json()["id"]
        rb = call_as(UID_B, stack.link, "POST", "/v1/tasks", {"repo": str(repo_b), **slow})
        assert rb.status == 201, rb.raw
        b = rb.json()["id"]
        end = time.monotonic() + 300
        while call_as(0, stack.link, "GET", f"/v1/tasks/{a}").json()["status"] != "running":
            assert time.monotonic() < end, "task A never started"
            time.sleep(1)

        def ids(uid: int) -> set[str]:
            return {t["id"] for t in call_as(uid, stack.link, "GET", "/v1/tasks").json()["tasks"]}

        assert ids(UID_A) == {a} and ids(UID_B) == {b} and {a, b} <= ids(0)
        for method, path in (("GET", f"/v1/tasks/{a}"), ("GET", f"/v1/tasks/{a}/result"),
                             ("POST", f"/v1/tasks/{a}/cancel")):  # fmt: skip
            r = call_as(UID_B, stack.link, method, path)
            assert r.status == 404, (path, r.raw)
        assert call_as(UID_A, stack.link, "POST", f"/v1/tasks/{b}/cancel").status == 404
        assert call_as(0, stack.link, "GET", f"/v1/tasks/{a}").json()["status"] == "running"
        assert call_as(0, stack.link, "GET", f"/v1/tasks/{b}").json()["status"] == "queued"
        info_a = call_as(0, stack.link, "GET", f"/v1/tasks/{a}").json()
        assert info_a["uid"] == UID_A
        # Root cancels A's running task; A reads its result once collected. B cancels its own.
        assert call_as(0, stack.link, "POST", f"/v1/tasks/{a}/cancel").status == 200
        assert call_as(UID_B, stack.link, "POST", f"/v1/tasks/{b}/cancel").status == 200
        end = time.monotonic() + 300
        while call_as(UID_A, stack.link, "GET", f"/v1/tasks/{a}").json()["status"] != "cancelled":
            assert time.monotonic() < end, "task A was not cancelled"
            time.sleep(1)
        assert call_as(UID_A, stack.link, "GET", f"/v1/tasks/{a}/result").status == 200
        assert call_as(UID_B, stack.link, "GET", f"/v1/tasks/{b}").json()["status"] == "cancelled"
        # A member may not delegate another member's repo (the launcher publishes into it).
        r = call_as(UID_A, stack.link, "POST", "/v1/tasks", {"repo": str(repo_b), **slow})
        assert r.status == 400 and "owned by uid" in r.json()["message"], r.raw
        assert ids(UID_A) == {a}
    finally:
        stop(proc)


def test_the_mcp_server_sees_only_the_tasks_of_the_user_it_runs_as(
    stack: Stack, launcher: subprocess.Popen[str]
) -> None:
    """The real MCP server, started as root with ``--user A``, drops to A and talks to the
    launcher as A: ``list_tasks`` shows A's task only; B's is unknown to ``status``,
    ``result`` and ``cancel``, and stays running."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    db = stack.data / "state.db"
    _insert(db, "task-a", "done", UID_A)
    _insert(db, "task-b", "running", UID_B)
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentbox", "mcp", "--user", str(UID_A)],
        env=stack.env,
    )

    def text(res: Any) -> str:
        return " ".join(getattr(c, "text", "") for c in getattr(res, "content", []))

    async def go() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            listed = text(await client.call_tool("list_tasks", {}))
            assert "task-a" in listed and "task-b" not in listed, listed
            for tool in ("status", "result", "cancel"):
                res = await client.call_tool(tool, {"id": "task-b"})
                assert res.is_error and "task-b" in text(res), (tool, text(res))
                assert "no such task" in text(res), (tool, text(res))

    anyio.run(go)
    assert call_as(0, stack.link, "GET", "/v1/tasks/task-b").json()["status"] == "running"
