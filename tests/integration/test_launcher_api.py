"""The launcher's unix-socket API with the real server (uvicorn) and the real client (httpx).

Also: the workspace chown walk (never follows a link), the SQLite store shared
between processes, and the watchdog process removing a real podman container
at its deadline (that sandbox goes through the leak guard, ``sandbox_factory``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.errors import PathRefused, RefusedError, TaskError, TaskIdRefused, TaskNotFound
from agentbox.launcher import Launcher, LauncherClient, TaskRequest
from agentbox.launcher._server import bind_socket, build_server, socket_path
from agentbox.launcher._watchdog import spawn_watchdog
from agentbox.launcher._workspace import check_owner, give_to_sandbox
from sandbox_leaks import SandboxTracker

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and podman need root")


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@l",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@l"}  # fmt: skip
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "i"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env, capture_output=True)
    return path


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[Launcher, LauncherClient]]:
    """A launcher served on its unix socket by uvicorn in a thread (peer-checked, as served)."""
    launcher = Launcher(settings, max_tasks=1)
    path = socket_path(settings.data_dir)
    server = build_server(launcher)
    listener = bind_socket(path)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    client = LauncherClient(path)
    try:
        yield launcher, client
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)
        launcher.close()


def test_models_and_empty_list(served: tuple[Launcher, LauncherClient]) -> None:
    _, client = served
    models = client.models()
    assert any(m.name == "replay-demo" and m.default for m in models)
    assert models[0].default
    assert client.list() == []


def test_errors_map_back_to_the_error_tree(
    served: tuple[Launcher, LauncherClient], settings: Settings, tmp_path: Path
) -> None:
    launcher, client = served
    with pytest.raises(TaskNotFound):
        client.get("no-such-task")
    with pytest.raises(TaskIdRefused):
        client.get("Bad/Id")  # refused by the client before it is sent
    outside = make_repo(tmp_path / "outside")
    with pytest.raises(PathRefused):
        client.submit(TaskRequest(repo=str(outside), task="x"))
    repo = make_repo(settings.repos_root / "r")
    with pytest.raises(RefusedError):
        client.submit(TaskRequest(repo=str(repo), task="x", model="nope"))
    assert not (settings.data_dir / "tasks").exists()
    # A finished task's result; one not finished answers 409 -> TaskError.
    launcher.store.insert(
        id="t-queued", status="collecting", repo=str(repo), task="x", model="replay-demo",
        budget=5, deadline=10.0, created_at=time.time(),
    )  # fmt: skip
    with pytest.raises(TaskError, match="not finished"):
        client.result("t-queued")
    info = client.get("t-queued")
    assert info.status == "collecting" and not info.terminal


def test_raw_bodies_are_parsed_strictly(
    served: tuple[Launcher, LauncherClient], settings: Settings
) -> None:
    import httpx

    _, client = served
    repo = make_repo(settings.repos_root / "r")
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(client.socket_path)))
    try:
        for body in (
            b"not json",
            b'{"repo": "%s", "task": "x", "budget": "5"}' % str(repo).encode(),
            b'{"repo": "%s", "task": "x", "image": "evil"}' % str(repo).encode(),
            b'{"repo": "%s", "task": "x", "task_id": "../x"}' % str(repo).encode(),
        ):
            r = http.post("http://l/v1/tasks", content=body)
            assert r.status_code == 422, body
            assert r.json()["error"] == "RefusedError"
        assert http.get("http://l/v1/tasks/..%2Fetc").status_code in (400, 404)
        assert http.delete("http://l/v1/tasks").status_code == 405
    finally:
        http.close()
    assert not (settings.data_dir / "tasks").exists()


def test_cancel_a_queued_task_never_starts_it(settings: Settings) -> None:
    repo = make_repo(settings.repos_root / "r")
    launcher = Launcher(settings, max_tasks=1)
    try:
        launcher.store.insert(
            id="t-q", status="queued", repo=str(repo), task="x", model="replay-demo", budget=5,
            deadline=10.0, created_at=time.time(), owner_pid=os.getpid(),
        )  # fmt: skip
        info = launcher.cancel("t-q")
        assert info.status == "cancelled"
        assert not (settings.data_dir / "tasks" / "t-q").exists()
    finally:
        launcher.close()


@needs_root
def test_chown_walk_never_follows_links(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f").write_text("x")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("s")
    (ws / "link-dir").symlink_to(victim)
    (ws / "sub" / "link-file").symlink_to(victim / "secret")
    uid = 164000
    give_to_sandbox(ws, uid)
    check_owner(ws, uid)
    for p in (ws, ws / "sub", ws / "sub" / "f", ws / "link-dir", ws / "sub" / "link-file"):
        assert p.lstat().st_uid == uid, p
    # The links' targets keep their owner.
    assert victim.stat().st_uid == 0 and (victim / "secret").stat().st_uid == 0
    # A workspace that is a link, or owned by someone else, is refused.
    link_ws = tmp_path / "link-ws"
    link_ws.symlink_to(ws)
    with pytest.raises(PathRefused):
        give_to_sandbox(link_ws, uid)
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 4242, 4242)
    with pytest.raises(PathRefused):
        give_to_sandbox(other, uid)
    with pytest.raises(PathRefused):
        check_owner(other, uid)


@needs_root
def test_socket_mode(settings: Settings) -> None:
    """``launcher serve`` makes its socket 0660; the client works through it."""
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    path = socket_path(settings.data_dir)
    try:
        for _ in range(200):
            if path.exists():
                break
            time.sleep(0.05)
        time.sleep(0.3)
        st = path.lstat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        with LauncherClient(path) as client:
            assert client.list() == []
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reaps it and closes its stderr pipe
    assert not path.exists()


@pytest.mark.podman
@needs_root
def test_watchdog_removes_the_sandbox_at_its_deadline(
    tmp_path: Path,
    default_image: str,
    sandbox_settings: Settings,
    sandbox_factory: Callable[[Backend, Settings], SandboxTracker],
) -> None:
    """The second line of the hard deadline: a separate process kills the sandbox by name."""
    from agentbox.backends import get_backend
    from agentbox.boxfile import Boxfile
    from agentbox.sandbox import spec_from_boxfile

    name = f"agentbox-task-wd-{os.getpid()}"
    spec = spec_from_boxfile(Boxfile(), sandbox_settings, name=name)
    backend = get_backend("podman", sandbox_settings)
    box = sandbox_factory(backend, sandbox_settings).create(spec)  # the leak guard
    try:
        wd = spawn_watchdog(
            backend="podman", sandbox=name, data_dir=tmp_path, at=time.time() + 1.0,
            gateway_pid=None, gateway_start=None, log_file=tmp_path / "wd.log",
        )  # fmt: skip
        assert wd.wait(60) == 0
        out = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert name not in out
        assert "deadline reached" in (tmp_path / "wd.log").read_text()
    finally:
        box.destroy()


def test_cli_refusals_exit_3_and_create_nothing(settings: Settings, tmp_path: Path) -> None:
    outside = make_repo(tmp_path / "outside")
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
    }
    agentbox = [sys.executable, "-m", "agentbox"]
    for args in (
        ["run", "--repo", str(outside), "do it"],
        ["run", "--repo", str(outside), "--id", "Bad..Id", "do it"],
    ):
        res = subprocess.run([*agentbox, *args], env=env, capture_output=True, text=True)
        assert res.returncode == 3, res.stderr
        assert "error" in res.stderr
    res = subprocess.run([*agentbox, "tasks", "--json"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert '"tasks": []' in res.stdout
    assert not (settings.data_dir / "tasks").exists()
    res = subprocess.run([*agentbox, "show", "nope"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "no such task" in res.stderr


def test_no_changes_means_no_branch_and_says_so_over_the_wire(
    served: tuple[Launcher, LauncherClient], settings: Settings
) -> None:
    """The launcher's own collect-and-publish path (a restarted launcher settling tasks
    whose launcher died): the unchanged workspace gets no commit and no branch, the
    edited one is published; the wire, the store and the report all say which."""
    from test_collect_support import git

    from agentbox.collect import prepare
    from agentbox.core.paths import TaskPaths
    from agentbox.launcher import _finish, _runner
    from agentbox.launcher.api import NO_CHANGES

    launcher, client = served
    gone = subprocess.Popen(["true"])
    gone.wait()  # the tasks' owner: a launcher that died
    repos = {}
    for tid, edit in (("t-same", False), ("t-edit", True)):
        repo = repos[tid] = make_repo(settings.repos_root / tid)
        (repo / "a.txt").write_text("a\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "a")
        paths = TaskPaths(settings.data_dir, tid)
        _runner._make_task_dir(paths)
        base = prepare(repo, paths.workspace, paths.shadow_git, paths.base_index)
        _finish.save_base(paths, base)
        # The agent: one leaves the files as they were (it only committed in its own
        # .git), the other edits one.
        git(paths.workspace, "commit", "-q", "--allow-empty", "-m", "agent")
        if edit:
            (paths.workspace / "a.txt").write_text("b\n")
        launcher.store.insert(
            id=tid, status="running", repo=str(repo), task="x", model="replay-demo", budget=5,
            deadline=3600.0, created_at=time.time(), owner_pid=gone.pid, owner_start=1.0,
        )  # fmt: skip
    assert set(launcher.reconcile()) == {"t-same", "t-edit"}

    same, edit_ = client.get("t-same"), client.get("t-edit")
    assert (same.changed, same.branch) == (False, None)
    assert (edit_.changed, edit_.branch) == (True, "agentbox/t-edit")
    res = client.result("t-same")
    assert (res.changed, res.branch, res.commit, res.diff) == (False, "", "", "")
    assert res.report["changed"] is False and res.report["branch"] is None
    assert res.report["tokens"] == {"input": 0, "output": 0, "cache_creation": 0, "cache_read": 0,
                                    "cost_usd": None}  # no gateway ran: cost unknown  # fmt: skip
    # No branch in the user's repo: its one ref is still its own.
    assert git(repos["t-same"], "for-each-ref", "--format=%(refname)").count("\n") == 1
    assert "agentbox/" not in git(repos["t-same"], "for-each-ref")
    log = (TaskPaths(settings.data_dir, "t-same").log_dir / "launcher.log").read_text()
    assert NO_CHANGES in log
    res = client.result("t-edit")
    assert res.changed is True and res.branch == "agentbox/t-edit" and "+b" in res.diff
    assert git(repos["t-edit"], "show", "agentbox/t-edit:a.txt") == "b\n"
