"""The data dir is closed to local users, the warm pool's included (issue 33 §3 and §7).

Everything here runs the real ``agentbox launcher serve`` as root (a warm pool of one,
real podman, the real Claude Code binary driven by a slow replay model) and looks at
its data dir as other local users (``setpriv``): an outsider (a user made here with
``useradd``, not in the group ``agentbox``) and a member of the group.

* While a task runs in a claimed pool sandbox and the pool holds a fresh one, the
  outsider lists and reads nothing under the data dir (the pool's slots, the go-file a
  claim writes with the task's text and token, the state db's log); a member reads
  nothing either but the shadow git dirs the MCP server is meant to fetch from; and a
  tree-wide permission walk (as root) finds no entry another user could read.
* ``agentbox launcher stop`` removes the idle pool sandbox; a launcher that starts with
  pool size 0 after one that died with a pool (its task still running in a claimed
  sandbox) removes the idle one at start, and the pool's bind mount once the task
  settles.
* A non-root ``agentbox rm``/``du``/``prune`` says in one line that it cannot open the
  store (before: a ``sqlite3.OperationalError`` traceback, then an ``AttributeError``).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.backends.base import OWNER_DATA_LABEL, data_dir_label
from agentbox.backends.podman._pool_slots import is_mount
from agentbox.core.paths import private_data_dir
from agentbox.core.wait import wait_until
from agentbox.launcher import LauncherClient, TaskRequest
from agentbox.launcher._store import Store
from git_helpers import git
from mount_helpers import assert_no_mounts_under

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the launcher as root")

GROUP = "agentbox"

SLOW = """\
name: slow
main: tools
side_reply: "Wait"
turns:
  - text: "Thinking for a long time."
    delay: 300
"""

# Run as another uid: list and read whatever it can under argv[1] (nothing followed), and
# try each path named on stdin (a name it could not list may still be opened).
_LOOK = r"""
import json, os, sys
root = sys.argv[1]
listed, read = [], []
def nofollow(n, f):
    return os.open(n, f | os.O_NOFOLLOW | os.O_NONBLOCK)
for top, dirs, files in os.walk(root, onerror=lambda e: None):
    listed.append(top)
    for name in files:
        p = os.path.join(top, name)
        try:
            with open(p, "rb", opener=nofollow) as fh:
                fh.read(1)
            read.append(p)
        except OSError:
            pass
for p in sys.stdin.read().split("\0"):
    if not p:
        continue
    try:
        with open(p, "rb", opener=nofollow) as fh:
            fh.read(1)
        read.append(p)
    except OSError:
        pass
print(json.dumps({"listed": listed, "read": sorted(set(read))}))
"""


def _until(cond: Callable[[], object], what: str, timeout: float = 300) -> None:
    """Wait (bounded) for ``cond``; fail naming ``what`` if it never holds."""
    wait_until(cond, timeout=timeout, on_timeout=lambda: AssertionError(f"never: {what}"))


def _group_gid() -> int:
    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "-f", "--system", GROUP], check=True)
        return grp.getgrnam(GROUP).gr_gid


@pytest.fixture(scope="module")
def outsider() -> Iterator[int]:
    """A local user of its own, in no agentbox group; removed after."""
    name = f"abx33-{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
    )
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], check=False)


def _as(
    uid: int, argv: list[str], *, member: bool = False, **kw: object
) -> subprocess.CompletedProcess[str]:
    groups = f"--groups={_group_gid()}" if member else "--clear-groups"
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", groups, "--", *argv],
        capture_output=True, text=True, timeout=300, check=False, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _look(uid: int, data: Path, *, member: bool = False) -> dict[str, list[str]]:
    """What ``uid`` lists and reads under ``data`` (also trying every path root sees)."""
    every = [str(p) for p in _entries(data) if not p.is_symlink()]
    out = _as(uid, [sys.executable, "-c", _LOOK, str(data)], member=member,
              input="\0".join(every))  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc: dict[str, list[str]] = json.loads(out.stdout)
    return doc


def _entries(root: Path) -> Iterator[Path]:
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            yield Path(top, name)


def _open_to_others(data: Path, gid: int) -> list[str]:
    """Entries under ``data`` a user who is neither their owner nor root could read (or
    list): every directory above reachable (``o+x``; or ``g+x`` with the group
    ``agentbox``, whose members may only reach the launcher's socket dir and the
    shadow git dirs of their tasks), and the entry itself readable by that class."""
    bad = []
    for p in [data, *_entries(data)]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            continue
        chain = [data / c for c in reversed(p.relative_to(data).parents)] if p != data else []
        others = all(c.lstat().st_mode & 0o001 for c in chain)
        group = all(
            c.lstat().st_mode & 0o001 or (c.lstat().st_gid == gid and c.lstat().st_mode & 0o010)
            for c in chain
        )
        rel = str(p.relative_to(data))
        if others and st.st_mode & 0o004:
            bad.append(f"{rel} {stat.filemode(st.st_mode)} (any user)")
        elif group and st.st_gid == gid and st.st_mode & 0o040:
            shared = "/shadow.git" in f"/{rel}" or rel == "run"
            if not shared:
                bad.append(f"{rel} {stat.filemode(st.st_mode)} (group {GROUP})")
    return bad


@dataclass
class Stack:
    base: Path
    env: dict[str, str]

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def link(self) -> Path:
        return self.data / "launcher.sock"

    def start(self, pool: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"],
            env={**self.env, "AGENTBOX_POOL_SIZE": str(pool)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _until(lambda: self._listening(proc), "the launcher listens", timeout=120)
        return proc

    def _listening(self, proc: subprocess.Popen[str]) -> bool:
        assert proc.poll() is None, f"launcher exited {proc.returncode}"
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.link))
            except OSError:
                return False
        return True

    def agentbox(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentbox", *args],
            env=self.env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    @property
    def slots(self) -> Path:
        return self.data / "pool" / "slots"

    def ready(self) -> list[Path]:
        return list(self.slots.glob("*/ready")) if self.slots.is_dir() else []

    @staticmethod
    def containers() -> set[str]:
        res = subprocess.run(
            ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        return set(res.stdout.split())


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGUSR2) -> None:
    """Stop a launcher: by default cancelling its tasks (``launcher stop --cancel``)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture
def stack() -> Iterator[Stack]:
    _group_gid()
    base = Path(tempfile.mkdtemp(prefix="agentbox-private-", dir="/var/tmp"))
    base.chmod(0o755)  # every user may reach the data dir's parent: the data dir guards
    (base / "repos").mkdir()
    (base / "slow.yaml").write_text(SLOW)
    (base / "models.toml").write_text('[models.slow]\nkind = "replay"\nupstream = "slow.yaml"\n')
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "AGENTBOX_FRONT_END": "off",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        yield Stack(base, env)
    finally:
        with contextlib.suppress(Exception):
            subprocess.run([sys.executable, "-m", "agentbox", "launcher", "stop", "--cancel"],
                           env=env, capture_output=True, timeout=300, check=False)  # fmt: skip
        _clean(base / "data")
        shutil.rmtree(base, ignore_errors=True)


def _clean(data: Path) -> None:
    """What a failed run may leave: this data dir's sandboxes, and mounts under it."""
    label = f"{OWNER_DATA_LABEL}={data_dir_label(data)}"
    names = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    if names:
        subprocess.run(["podman", "rm", "-f", "-t", "0", *names], capture_output=True, check=False)
    with contextlib.suppress(AssertionError):
        assert_no_mounts_under(data)  # unmounts what it finds


def _repo(stack: Stack) -> Path:
    path = stack.base / "repos" / "r"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


@pytest.mark.podman
@pytest.mark.claude
def test_the_data_dir_and_the_pool_are_closed_and_the_pool_goes_with_its_launcher(
    stack: Stack, outsider: int, default_image: str
) -> None:
    gid = _group_gid()
    repo = _repo(stack)
    first = stack.start(pool=1)
    try:
        _until(lambda: bool(stack.ready()), "the keeper fills a sandbox")
        client = LauncherClient(stack.link)
        secret = f"the task text {secrets.token_hex(6)}"
        task = client.submit(TaskRequest(repo=str(repo), task=secret, model="slow")).id
        # Claimed: its record is written, and the keeper refills the pool.
        claims = stack.data / "pool" / "claims"
        _until(lambda: any(claims.glob("*.json")), "the task is served by the pool")
        _until(lambda: bool(stack.ready()), "the keeper refills the pool")
        _until(lambda: client.get(task).status == "running", "the task runs")
        # The outsider lists and reads nothing at all; a member of the group reads
        # nothing it could not before (its tasks' shadow git dirs).
        seen = _look(outsider, stack.data)
        assert seen == {"listed": [], "read": []}, seen
        member = _look(outsider, stack.data, member=True)
        assert member["listed"] == [], member
        assert [p for p in member["read"] if "/shadow.git/" not in p] == [], member
        # As root: no entry of the data dir is open to another user, pool included.
        assert _open_to_others(stack.data, gid) == []
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            if (stack.data / name).exists():
                assert stat.S_IMODE((stack.data / name).stat().st_mode) == 0o600, name
        # The launcher dies with its pool: the task runs on in its claimed sandbox.
        _stop(first, signal.SIGKILL)
        idle = [p.parent.name for p in stack.ready()]
        assert idle and set(idle) <= stack.containers()
        # A launcher with no pool: the idle sandbox goes at its start, the claimed one
        # stays (a task's), and the pool's mount goes once that task settles.
        second = stack.start(pool=0)
        try:
            assert not stack.ready() and not set(idle) & stack.containers()
            assert is_mount(stack.data / "pool")  # the task's slot is still bound there
            client.cancel(task)
            _until(lambda: client.get(task).finished_at is not None, "the task ends")
            _until(lambda: not any(stack.slots.iterdir()), "its slot is released")
            assert not is_mount(stack.data / "pool")
        finally:
            _stop(second)
        # A stop drains the idle pool.
        third = stack.start(pool=1)
        try:
            _until(lambda: bool(stack.ready()), "the keeper fills a sandbox")
            idle = [p.parent.name for p in stack.ready()]
            out = stack.agentbox("launcher", "stop")
            assert out.returncode == 0, out.stderr
            third.wait(120)
        finally:
            _stop(third)
        assert not set(idle) & stack.containers(), idle
        assert not stack.ready() and not is_mount(stack.data / "pool")
        assert_no_mounts_under(stack.data)
    finally:
        _stop(first)


@pytest.mark.parametrize("command", [["rm", "t-0123456789ab"], ["du"], ["prune"]])
def test_a_non_root_retention_command_says_so_in_one_line(
    stack: Stack, outsider: int, command: list[str]
) -> None:
    data = private_data_dir(stack.data)
    Store(data / "state.db").close()
    env = {**stack.env, "HOME": "/"}
    for member in (False, True):
        out = _as(outsider, [sys.executable, "-m", "agentbox", *command], member=member,
                  env=env, cwd="/")  # fmt: skip
        assert out.returncode != 0
        assert "Traceback" not in out.stderr and "Error:" not in out.stderr, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot open the task store"), lines
        assert "run this as root" in lines[0]
