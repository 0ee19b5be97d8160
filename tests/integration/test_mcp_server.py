"""The MCP server's gate and input checks, with the official ``mcp`` SDK as the client.

These run the real ``agentbox mcp`` process (as root, so it really drops to an
unprivileged uid) over both transports. Nothing here needs a running launcher:
every request below is refused before the launcher would be asked, so the
launcher socket is a bound-but-silent placeholder and any request that did
reach it would hang and fail the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from agentbox.mcp import process_posture, token_path
from git_helpers import git
from net_helpers import free_port, mcp_http_transport

MCP_UID = 64123  # no passwd entry: an identity that owns nothing but the test repos

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to test the privilege drop")


def make_repo(path: Path, uid: int = MCP_UID) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    subprocess.run(["chown", "-R", "-h", f"{uid}:{uid}", str(path)], check=True)
    return path


@dataclass
class World:
    base: Path
    repos: Path
    data: Path
    repo: Path
    env: dict[str, str]

    def snapshot(self) -> set[str]:
        """Every path under the repos root and the data dir (to prove nothing was written)."""
        out: set[str] = set()
        for root in (self.repos, self.data):
            for dirpath, dirnames, filenames in os.walk(root):
                out.update(os.path.join(dirpath, n) for n in dirnames + filenames)
        return out


@pytest.fixture
def world() -> Iterator[World]:
    # Not under tmp_path: pytest's temp root is 0700 root, which the dropped
    # server could not traverse to reach its repos.
    base = Path(tempfile.mkdtemp(prefix="agentbox-mcp-"))
    base.chmod(0o755)
    repos = base / "repos"
    repos.mkdir()
    os.chown(repos, MCP_UID, MCP_UID)
    data = base / "data"
    data.mkdir(mode=0o700)
    repo = make_repo(repos / "proj")
    # A placeholder launcher socket that accepts nothing: a request reaching it hangs.
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(data / "launcher.sock"))
    (data / "launcher.sock").chmod(0o666)  # reachable by the dropped server, but it never answers
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(data),
        "AGENTBOX_REPOS_ROOT": str(repos),
    }
    try:
        yield World(base, repos, data, repo, env)
    finally:
        sock.close()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class HttpServer:
    proc: subprocess.Popen[bytes]
    port: int
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"


def _start_http(world: World, *extra: str) -> HttpServer:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "mcp", "--http", f"127.0.0.1:{port}", *extra],
        env=world.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    token = token_path(world.data).read_text().strip()
    return HttpServer(proc, port, token)


@pytest.fixture
def http_server(world: World) -> Iterator[HttpServer]:
    srv = _start_http(world, "--user", str(MCP_UID))
    try:
        yield srv
    finally:
        with srv.proc:  # closes its pipes
            srv.proc.terminate()
            try:
                srv.proc.wait(10)
            except subprocess.TimeoutExpired:
                srv.proc.kill()


def _http_client(srv: HttpServer, token: str | None = None) -> Client:
    return Client(mcp_http_transport(srv.url, token or srv.token))


def _stdio_client(world: World) -> Client:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentbox", "mcp", "--user", str(MCP_UID)],
        env=world.env,
    )
    return Client(params)


# -- the HTTP gate ------------------------------------------------------------------


INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"},
    },
}
ACCEPT = "application/json, text/event-stream"


def _post(srv: HttpServer, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(srv.url, json=INIT, headers={"Accept": ACCEPT, **headers}, timeout=10)


def test_token_is_0600_and_required(http_server: HttpServer, world: World) -> None:
    path = token_path(world.data)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    auth = {"Authorization": f"Bearer {http_server.token}"}
    assert _post(http_server, {}).status_code == 401
    assert _post(http_server, {"Authorization": "Bearer nope"}).status_code == 401
    assert _post(http_server, {"Authorization": f"Bearer {http_server.token}x"}).status_code == 401
    assert _post(http_server, {"Authorization": f"Basic {http_server.token}"}).status_code == 401
    assert _post(http_server, auth).status_code == 200


def test_host_and_origin_checked(http_server: HttpServer) -> None:
    auth = {"Authorization": f"Bearer {http_server.token}"}
    p = http_server.port
    assert _post(http_server, {**auth, "Host": "evil.example"}).status_code == 403
    assert _post(http_server, {**auth, "Host": f"evil.example:{p}"}).status_code == 403
    assert _post(http_server, {**auth, "Host": f"127.0.0.1:{p + 1}"}).status_code == 403
    assert _post(http_server, {**auth, "Origin": "http://evil.example"}).status_code == 403
    assert _post(http_server, {**auth, "Origin": f"http://evil.example:{p}"}).status_code == 403
    assert _post(http_server, {**auth, "Origin": f"http://localhost:{p}"}).status_code == 200
    assert _post(http_server, {**auth, "Host": f"localhost:{p}"}).status_code == 200
    assert _post(http_server, {**auth, "Host": f"127.0.0.1:{p}@evil.example"}).status_code == 403
    assert _post(http_server, {**auth, "Origin": "null"}).status_code == 403
    # A second Authorization or Host header is refused, not resolved either way.
    headers = [
        ("Accept", ACCEPT),
        ("Authorization", "Bearer nope"),
        ("Authorization", f"Bearer {http_server.token}"),
    ]
    res = httpx.post(http_server.url, json=INIT, headers=headers, timeout=10)
    assert res.status_code == 401


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:8765", "192.0.2.1:8765", "localhost:8765", "[::]:8765"]
)
def test_non_loopback_bind_refused_at_start(world: World, listen: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "agentbox", "mcp", "--http", listen, "--user", str(MCP_UID)],
        env=world.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "loopback address only" in " ".join(res.stderr.split())
    assert not token_path(world.data).exists()  # refused before anything was written


def test_root_owned_repos_root_needs_a_user(world: World) -> None:
    os.chown(world.repos, 0, 0)
    res = subprocess.run(
        [sys.executable, "-m", "agentbox", "mcp"],
        env=world.env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 3
    assert "will not run as root" in " ".join(res.stderr.split())


def test_unreachable_launcher_socket_refused_at_start(world: World) -> None:
    (world.data / "launcher.sock").chmod(0o660)  # root:root, and the server is not in group 0
    res = subprocess.run(
        [sys.executable, "-m", "agentbox", "mcp", "--user", str(MCP_UID)],
        env=world.env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 4, res.stderr
    assert "groupadd --system agentbox" in " ".join(res.stderr.split())


# -- privileges -------------------------------------------------------------------


def test_server_process_has_no_privileges(http_server: HttpServer) -> None:
    pid = http_server.proc.pid

    async def call() -> None:  # a tool call runs in a worker thread: one more to check
        async with _http_client(http_server) as client:
            res = await client.call_tool("status", {"id": "t-1"})
            assert res.is_error  # the placeholder launcher never answers

    anyio.run(call)
    tids = [p.name for p in Path(f"/proc/{pid}/task").iterdir()]
    assert len(tids) > 1  # each thread must carry the dropped state
    for tid in tids:
        st = process_posture(f"{pid}/task/{tid}")
        assert st["Uid"].split() == [str(MCP_UID)] * 4, tid
        assert st["Gid"].split() == [str(MCP_UID)] * 4, tid
        for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[key], 16) == 0, (tid, key, st[key])
        assert st["NoNewPrivs"] == "1", tid
    # Its own mount namespace, with the root read-only and only the repos root writable.
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    mounts = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        mounts[fields[4]] = fields[5].split(",")
    assert "ro" in mounts["/"]


def _as_server(pid: int, groups: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in the server's mount namespace with the server's uid and groups."""
    cmd = ["nsenter", f"--target={pid}", "--mount", "--", "setpriv"]
    cmd += [f"--reuid={MCP_UID}", f"--regid={MCP_UID}", f"--groups={groups}"]
    cmd += ["--bounding-set=-all", "--no-new-privs", "--", *argv]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_server_view_cannot_open_launcher_paths(http_server: HttpServer, world: World) -> None:
    pid = http_server.proc.pid
    groups = process_posture(pid)["Groups"].replace(" ", ",") or str(MCP_UID)
    tasks = world.data / "tasks" / "t-1"
    tasks.mkdir(parents=True, mode=0o700)
    (tasks / "secret").write_text("x")
    for path in (token_path(world.data), tasks / "secret", world.data / "launcher.sock"):
        res = _as_server(pid, groups, "cat", str(path))
        assert res.returncode != 0 and "Permission denied" in res.stderr, (path, res)
    for path in ("/etc/agentbox-mcp-planted", f"{world.base}/planted", "/tmp/agentbox-planted"):
        res = _as_server(pid, groups, "touch", path)
        assert res.returncode != 0, (path, res)
        assert not Path(path).exists()
    # ... while the repos root, the one place it writes to, is writable.
    res = _as_server(pid, groups, "touch", str(world.repo / ".git" / "probe"))
    assert res.returncode == 0, res.stderr
    (world.repo / ".git" / "probe").unlink()


def test_dropped_identity_cannot_open_launcher_paths(world: World) -> None:
    # The same drop the server does, then try what a compromised server would.
    tasks = world.data / "tasks" / "t-1"
    tasks.mkdir(parents=True, mode=0o700)
    (tasks / "secret").write_text("x")
    token_path(world.data).parent.mkdir(mode=0o700)
    token_path(world.data).write_text("y" * 40)
    paths = [str(tasks / "secret"), str(token_path(world.data)), str(world.data / "tasks")]
    paths.append("/etc/shadow")
    code = f"""
import os, sys
from pathlib import Path
from agentbox.mcp import drop_privileges, resolve_identity
drop_privileges(resolve_identity({str(MCP_UID)!r}, Path({str(world.repos)!r}), None))
bad = []
for p in {paths!r}:
    try:
        os.open(p, os.O_RDONLY)
        bad.append(p)
    except PermissionError:
        pass
try:
    os.setuid(0)
    bad.append("setuid(0)")
except PermissionError:
    pass
print("OPENED", bad)
sys.exit(1 if bad else 0)
"""
    res = subprocess.run(
        [sys.executable, "-c", code], env=world.env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


# -- tool calls refused before anything starts --------------------------------------


def _bad_calls(world: World) -> list[tuple[str, dict[str, object], str]]:
    outside = world.base / "outside"
    make_repo(outside)
    link = world.repos / "link"
    link.symlink_to(outside)
    inner_link = world.repos / "inner-link"
    inner_link.symlink_to(world.repo)
    rootowned = make_repo(world.repos / "rootowned", uid=0)
    (world.repos / "plain").mkdir()
    os.chown(world.repos / "plain", MCP_UID, MCP_UID)
    gitfile = world.repos / "gitfile"
    gitfile.mkdir()
    (gitfile / ".git").write_text(f"gitdir: {outside}/.git\n")
    subprocess.run(["chown", "-R", f"{MCP_UID}:{MCP_UID}", str(gitfile)], check=True)
    return [
        ("delegate", {"repo": str(outside), "task": "x"}, "outside"),
        ("delegate", {"repo": str(link), "task": "x"}, "outside"),
        ("delegate", {"repo": str(inner_link), "task": "x"}, "symlink"),
        ("delegate", {"repo": f"{world.repos}/../outside", "task": "x"}, ".."),
        ("delegate", {"repo": f"{world.repo}/../proj", "task": "x"}, ".."),
        ("delegate", {"repo": "proj", "task": "x"}, "absolute"),
        ("delegate", {"repo": str(rootowned), "task": "x"}, "owned by uid 0"),
        ("delegate", {"repo": str(world.repos / "plain"), "task": "x"}, "not a git"),
        ("delegate", {"repo": str(gitfile), "task": "x"}, "gitdir files are refused"),
        ("delegate", {"repo": str(world.repos / "missing"), "task": "x"}, "does not exist"),
        ("delegate", {"repo": "/etc", "task": "x"}, "outside"),
        ("delegate", {"repo": str(world.repo)}, "task"),
        ("delegate", {"repo": str(world.repo), "task": ""}, "task"),
        ("delegate", {"repo": str(world.repo), "task": "x", "budget": "lots"}, "budget"),
        ("delegate", {"repo": str(world.repo), "task": "x", "budget": -1}, "budget"),
        ("delegate", {"repo": str(world.repo), "task": "x", "deadline": 1e9}, "deadline"),
        ("delegate", {"repo": str(world.repo), "task": "y" * 40000}, "task"),
        ("delegate", {"repo": 5, "task": "x"}, "repo"),
        ("status", {"id": "../../etc"}, "task id"),
        ("result", {"id": "A" * 65}, "id"),
        ("cancel", {"id": "Bad_Id"}, "task id"),
        ("publish", {"task_id": "../x", "pr": True}, "task id"),
        ("publish", {"task_id": "t-1", "remote": "-oops"}, "remote"),
        ("status", {}, "id"),
        ("no_such_tool", {}, "no_such_tool"),
    ]


async def _check_refusals(client: Client, world: World) -> None:
    calls = _bad_calls(world)
    before = world.snapshot()
    async with client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert names == {"delegate", "status", "result", "transcript", "cancel", "list_tasks",
                         "models", "publish"}  # fmt: skip
        for name, args, needle in calls:
            with anyio.fail_after(20):  # reaching the silent placeholder launcher would hang
                res = await client.call_tool(name, args)
            text = " ".join(getattr(c, "text", "") for c in res.content)
            assert res.is_error, (name, args, text)
            assert needle.lower() in text.lower(), (name, args, text)
    assert world.snapshot() == before  # nothing written anywhere


def test_bad_tool_calls_refused_over_http(http_server: HttpServer, world: World) -> None:
    anyio.run(_check_refusals, _http_client(http_server), world)


def test_bad_tool_calls_refused_over_stdio(world: World) -> None:
    anyio.run(_check_refusals, _stdio_client(world), world)


def test_confined_dropped_process_fetches_only_into_the_repo(world: World) -> None:
    # A launcher-like shadow dir (root-owned, readable) holding agentbox/t-1.
    shadow = world.base / "shadow.git"
    shutil.copytree(world.repo / ".git", shadow, symlinks=True)
    subprocess.run(["chown", "-R", "0:0", str(shadow)], check=True)
    git(shadow, "config", "core.bare", "true")
    git(shadow, "branch", "agentbox/t-1", "main")
    commit = git(shadow, "rev-parse", "agentbox/t-1").strip()
    code = f"""
import os, sys
from pathlib import Path
from agentbox.mcp import drop_privileges, fetch_branch, resolve_identity
from agentbox.mcp._confine import confine_filesystem
ident = resolve_identity({str(MCP_UID)!r}, Path({str(world.repos)!r}), None)
confine_filesystem(ident.uid, {{ident.gid}}, writable=[Path({str(world.repos)!r})])
drop_privileges(ident)
print(fetch_branch(Path({str(world.repo)!r}), Path({str(shadow)!r}), "t-1", {commit!r}))
for p in [{str(world.base / "planted")!r}, "/var/tmp/agentbox-planted"]:
    try:
        open(p, "w")
        print("WROTE", p)
        sys.exit(1)
    except OSError:
        pass
"""
    res = subprocess.run(
        [sys.executable, "-c", code], env=world.env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "agentbox/t-1" in res.stdout
    assert (
        git(world.repo, "-c", f"safe.directory={world.repo}", "rev-parse", "agentbox/t-1").strip()
        == commit
    )
    ref = world.repo / ".git" / "refs" / "heads" / "agentbox" / "t-1"
    assert ref.stat().st_uid == MCP_UID  # written as the user, not as root
    assert not (world.base / "planted").exists()
    assert not Path("/var/tmp/agentbox-planted").exists()
