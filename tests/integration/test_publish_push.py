"""``agentbox publish ID --push [--pr]`` with real git and a real non-root repo owner (issue 28 §5).

The remote is a bare repo over ``file://`` owned by the same user; the push runs as the
repo's owner (never root), with hooks off, never by force. The pull request goes to a
local GitHub API server that validates every request against GitHub's OpenAPI description
(tests/forge_servers.py).
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_collect_support import git, make_repo

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import CollectError, ForgeError, PushRefused
from agentbox.launcher import Launcher
from agentbox.launcher.pushapi import PushRequest
from forge_servers import ForgeServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes a user and chowns to it")

FILES = {"README.md": "hello\n", "src/app.py": "x = 1\n"}
TOKEN = "ghp_pushtest_5f3a9c0e1d2b4a6f8e7d"


@pytest.fixture(scope="module")
def owner() -> Iterator[pwd.struct_passwd]:
    """A real local user (no home), removed after."""
    name = f"abxpr-{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                    "/usr/sbin/nologin", name], check=True)  # fmt: skip
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


def _chown(path: Path, pw: pwd.struct_passwd) -> None:
    subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(path)], check=True)


def _finished(settings: Settings, tid: str, pw: pwd.struct_passwd | None) -> tuple[Path, Path, str]:
    """A finished, unpublished task on a repo owned by ``pw`` (root's when None), whose
    ``origin`` is a bare repo of the same owner. Returns (repo, remote, result commit)."""
    from agentbox.collect import prepare
    from agentbox.launcher import _finish, _runner
    from agentbox.launcher._context import TaskContext, TaskLog
    from agentbox.launcher._store import Store

    repo = make_repo(settings.repos_root / f"repo-{tid}", FILES)
    remote = settings.repos_root.parent / f"remote-{tid}.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "main")
    paths = TaskPaths(settings.data_dir, tid)
    store = Store(settings.data_dir / "state.db")
    _runner._make_task_dir(paths)
    base = prepare(repo, paths.workspace, paths.shadow_git, paths.base_index)
    _finish.save_base(paths, base)
    (paths.workspace / "src/app.py").write_text("x = 2\n")
    store.insert(
        id=tid, status="running", repo=str(repo.resolve()), task="make x two\nplease",
        model="replay-demo", budget=5, deadline=3600.0, created_at=time.time(), publish=0,
        caller_uid=pw.pw_uid if pw else 0,
    )  # fmt: skip
    _finish.collect_and_finish(
        TaskContext(settings, store, paths, TaskLog(paths, store)), store.get(tid),
        status="done", error=None, exit_code=0,
    )  # fmt: skip
    commit = store.get(tid).commit_id
    assert commit
    if pw is not None:
        _chown(repo, pw)
        _chown(remote, pw)
    return repo, remote, commit


def _remote_ref(remote: Path, branch: str) -> str:
    argv = ["git", "--git-dir", str(remote), "for-each-ref", "--format=%(objectname)"]
    out = subprocess.run([*argv, f"refs/heads/{branch}"], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return out.stdout.strip()


def _hooks(repo: Path, marker: Path) -> None:
    """A pre-push hook in .git/hooks and in a core.hooksPath dir: each would leave a mark."""
    hook = f"#!/bin/sh\necho ran >> {marker}\n"
    for d in (repo / ".git/hooks", repo / ".myhooks"):
        d.mkdir(exist_ok=True)
        (d / "pre-push").write_text(hook)
        (d / "pre-push").chmod(0o755)
    git(repo, "config", "core.hooksPath", str(repo / ".myhooks"))


def test_push_runs_as_the_owner_with_hooks_off_and_is_idempotent(
    sandbox_settings: Settings, owner: pwd.struct_passwd
) -> None:
    tid = "t-push"
    repo, remote, commit = _finished(sandbox_settings, tid, owner)
    marker = repo / ".git" / "hook-ran"  # the owner's to write
    _hooks(repo, marker)
    _chown(repo, owner)
    launcher = Launcher(sandbox_settings, max_tasks=1)
    try:
        got = launcher.push(tid, PushRequest())
        assert got.pushed and got.branch == f"agentbox/{tid}" and got.commit == commit
        assert _remote_ref(remote, f"agentbox/{tid}") == commit
        assert not marker.exists(), "a pre-push hook ran"
        # Written as the owner: every object file the push added is theirs, none root's.
        owners = {p.stat().st_uid for p in (remote / "objects").rglob("*") if p.is_file()}
        assert owners == {owner.pw_uid}
        again = launcher.push(tid, PushRequest())
        assert not again.pushed and _remote_ref(remote, f"agentbox/{tid}") == commit
    finally:
        launcher.close()
    # Control: the same hooks do run for a push git makes the ordinary way.
    subprocess.run(["setpriv", f"--reuid={owner.pw_uid}", f"--regid={owner.pw_gid}",
                    "--clear-groups", "git", "-C", str(repo), "push", "-q", "origin",
                    f"{commit}:refs/heads/control"], check=True, capture_output=True,
                   env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})  # fmt: skip
    assert marker.exists()


def test_a_remote_branch_that_is_not_an_ancestor_is_never_forced(
    sandbox_settings: Settings, owner: pwd.struct_passwd, tmp_path: Path
) -> None:
    tid = "t-noforce"
    _repo, remote, _commit = _finished(sandbox_settings, tid, owner)
    other = make_repo(tmp_path / "other", {"theirs.txt": "someone else's\n"})
    subprocess.run(["chown", "-R", "0:0", str(remote)], check=True)  # root pushes theirs
    git(other, "push", "-q", f"file://{remote}", f"main:refs/heads/agentbox/{tid}")
    _chown(remote, owner)
    theirs = _remote_ref(remote, f"agentbox/{tid}")
    launcher = Launcher(sandbox_settings, max_tasks=1)
    try:
        with pytest.raises(PushRefused, match="never forces"):
            launcher.push(tid, PushRequest())
    finally:
        launcher.close()
    assert _remote_ref(remote, f"agentbox/{tid}") == theirs


def test_a_root_owned_repo_is_not_pushed_as_root(sandbox_settings: Settings) -> None:
    tid = "t-rootrepo"
    _, remote, _ = _finished(sandbox_settings, tid, None)
    launcher = Launcher(sandbox_settings, max_tasks=1)
    try:
        with pytest.raises(PushRefused, match="never as root"):
            launcher.push(tid, PushRequest())
    finally:
        launcher.close()
    assert _remote_ref(remote, f"agentbox/{tid}") == ""


def _cli(settings: Settings, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {"PATH": os.environ["PATH"], "AGENTBOX_DATA_DIR": str(settings.data_dir),
            "AGENTBOX_REPOS_ROOT": str(settings.repos_root), **env}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "agentbox", *args], env=full,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_cli_publish_pr_pushes_and_opens_a_pull_request_with_the_report(
    sandbox_settings: Settings, owner: pwd.struct_passwd
) -> None:
    tid = "t-clipr"
    repo, remote, commit = _finished(sandbox_settings, tid, owner)
    # Fetched from GitHub, pushed over file:// (a pushurl): the forge is the URL's.
    git(repo, "remote", "set-url", "origin", "https://github.com/octo/hello.git")
    git(repo, "remote", "set-url", "--push", "origin", f"file://{remote}")
    _chown(repo, owner)
    with ForgeServer("github") as server:
        env = {"AGENTBOX_FORGE_HOSTS": f"github.com=github:{server.url}"}
        res = _cli(sandbox_settings, "publish", tid, "--pr", env=env)
        assert res.returncode != 0 and "no github token" in " ".join(res.stderr.split())
        assert _remote_ref(remote, f"agentbox/{tid}") == "", "pushed before the token was known"
        res = _cli(sandbox_settings, "publish", tid, "--pr", "--draft",
                   env={**env, "GITHUB_TOKEN": TOKEN})  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert f"pushed agentbox/{tid} to origin" in res.stdout
        assert "pull request opened: https://github.com/octo/hello/pull/1347" in res.stdout
        assert server.errors == []
        (create,) = [r for r in server.requests if r.method == "POST"]
        assert create.body["head"] == f"agentbox/{tid}" and create.body["base"] == "main"
        assert create.body["draft"] is True
        assert create.body["title"] == f"make x two [agentbox {tid}]"
        body = create.body["body"]
        for part in ("### Summary", "### Tests", "none run", "### Task", "tokens:", "cost",
                     "### Files that run code", f"agentbox logs {tid}"):  # fmt: skip
            assert part in body, part
        assert _remote_ref(remote, f"agentbox/{tid}") == commit
        res = _cli(sandbox_settings, "publish", tid, "--pr", "--json",
                   env={**env, "GITHUB_TOKEN": TOKEN})  # fmt: skip
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["existed"] is True and got["pushed"] is False
    paths = TaskPaths(sandbox_settings.data_dir, tid)
    report = json.loads(paths.report_file.read_text())
    assert report["pull_request"] == "https://github.com/octo/hello/pull/1347"
    for text in (res.stdout, res.stderr, paths.report_file.read_text(),
                 (paths.log_dir / "launcher.log").read_text()):  # fmt: skip
        assert TOKEN not in text


def test_a_remote_on_no_forge_is_refused_before_anything_is_pushed(
    sandbox_settings: Settings, owner: pwd.struct_passwd
) -> None:
    tid = "t-noforge"
    _, remote, _ = _finished(sandbox_settings, tid, owner)
    launcher = Launcher(sandbox_settings, max_tasks=1)
    try:
        with pytest.raises(ForgeError, match="not on a forge"):
            launcher.push(tid, PushRequest(pr=True), env={"GITHUB_TOKEN": TOKEN})
    finally:
        launcher.close()
    assert _remote_ref(remote, f"agentbox/{tid}") == ""


def test_run_pr_pushes_and_opens_the_pull_request_when_the_task_is_done(
    sandbox_settings: Settings, owner: pwd.struct_passwd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``agentbox run --pr`` in the foreground (the CLI in this process, the sandbox the
    FakeBackend): the task ends done with a result, which is pushed as the repo's owner
    and becomes a pull request whose body is its report."""
    from test_lifecycle_fake import _spawn_gateway
    from typer.testing import CliRunner

    from agentbox.backends.fake import FakeBackend, FakeScript
    from agentbox.cli import app
    from agentbox.launcher import _runner

    settings = sandbox_settings
    repo = make_repo(settings.repos_root / "repo-run", FILES)
    remote = settings.repos_root.parent / "remote-run.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    git(repo, "remote", "add", "origin", "https://github.com/octo/hello.git")
    git(repo, "remote", "set-url", "--push", "origin", f"file://{remote}")
    _chown(repo, owner)
    _chown(remote, owner)
    FakeBackend.reset()
    monkeypatch.setattr(_runner, "spawn_gateway", _spawn_gateway)
    with ForgeServer("github") as server:
        for k, v in {"AGENTBOX_DATA_DIR": str(settings.data_dir),
                     "AGENTBOX_REPOS_ROOT": str(settings.repos_root),
                     "AGENTBOX_FORGE_HOSTS": f"github.com=github:{server.url}",
                     "GITHUB_TOKEN": TOKEN}.items():  # fmt: skip
            monkeypatch.setenv(k, v)
        with (
            FakeBackend.installed_as("podman"),
            FakeBackend.scripted(FakeScript(files={"src/app.py": b"x = 3\n"})),
        ):
            res = CliRunner().invoke(app, ["run", "--repo", str(repo), "--id", "t-runpr",
                                           "--pr", "--json", "set x to three"])  # fmt: skip
        assert FakeBackend.live_names() == []
        FakeBackend.reset()
        assert res.exit_code == 0, (res.output, res.exception)
        out = json.loads(res.stdout[res.stdout.index("{") :])
        assert out["task"]["status"] == "done"
        push = out["push"]
        assert push["pushed"] and push["pull_request"] == "https://github.com/octo/hello/pull/1347"
        assert server.errors == []
        (create,) = [r for r in server.requests if r.method == "POST"]
        assert create.body["head"] == "agentbox/t-runpr"
        assert create.body["title"] == "set x to three [agentbox t-runpr]"
    commit = git(repo, "rev-parse", "agentbox/t-runpr").strip()
    assert _remote_ref(remote, "agentbox/t-runpr") == commit
    assert TOKEN not in res.stdout


def test_push_over_https_uses_the_owners_own_credential_helper(
    sandbox_settings: Settings, tmp_path: Path
) -> None:
    """The push to a real smart-HTTP remote (``git http-backend`` behind nginx with TLS and
    basic auth, tests/private_servers.py) authenticates with the repo owner's own git
    credential helper, read from their HOME as them: without it the push fails, with it
    the branch lands, and the password is in no launcher log or report."""
    from private_servers import GIT_HOST, missing, private_servers

    if missing(npm=False):
        pytest.skip(f"private servers need {missing(npm=False)} (scripts/setup.sh)")
    name = f"abxph-{secrets.token_hex(3)}"
    home = sandbox_settings.repos_root.parent / "home"
    home.mkdir()
    subprocess.run(["useradd", "--system", "--home-dir", str(home), "--shell",
                    "/usr/sbin/nologin", name], check=True)  # fmt: skip
    try:
        pw = pwd.getpwnam(name)
        tid = "t-https"
        repo, _, commit = _finished(sandbox_settings, tid, pw)
        with private_servers(tmp_path / "srv", npm=False) as srv:
            git(repo, "remote", "set-url", "origin", srv.git_url)
            # The owner's own git config: the test CA, the name's address, a credential store.
            (home / "ca.pem").write_bytes(srv.ca_path.read_bytes())
            (home / ".gitconfig").write_text(
                f"[http]\n\tsslCAInfo = {home / 'ca.pem'}\n"
                f"\tcurloptResolve = {GIT_HOST}:443:{srv.addresses[GIT_HOST]}\n"
                "[credential]\n\thelper = store\n"
            )
            _chown(home, pw)
            _chown(repo, pw)
            launcher = Launcher(sandbox_settings, max_tasks=1)
            try:
                with pytest.raises(CollectError, match=r"Username|Authentication|401"):
                    launcher.push(tid, PushRequest())  # no credential yet: refused by nginx
                creds = home / ".git-credentials"
                creds.write_text(f"https://{srv.user}:{srv.password}@{GIT_HOST}\n")
                creds.chmod(0o600)
                _chown(home, pw)
                got = launcher.push(tid, PushRequest())
            finally:
                launcher.close()
            assert got.pushed and got.remote_url == srv.git_url
            out = subprocess.run(["git", "--git-dir", str(srv.git_dir), "rev-parse",
                                  f"agentbox/{tid}"], capture_output=True, text=True)  # fmt: skip
            assert out.stdout.strip() == commit
            paths = TaskPaths(sandbox_settings.data_dir, tid)
            for f in (paths.log_dir / "launcher.log", paths.report_file):
                for value in srv.secrets():
                    assert value not in f.read_text()
    finally:
        subprocess.run(["userdel", name], check=False)
