"""The resident front end (:mod:`agentbox.front`): a command served by the fork server is
the command its caller would have run itself, and a caller with fewer rights is not served.

Everything here runs the real fork server (``python -m agentbox.front.server``) and
the real client (``python -m agentbox``, the console script's entry), as root:

* served commands print, and exit, exactly as in-process ones do: text, JSON,
  usage errors, stdin, relative paths, FORCE_COLOR and a terminal's colours;
* the forked command takes on its caller's cgroup, nice value, limits, umask,
  ignored signals, environment, working directory and descriptors;
* signals reach it; a client killed with SIGKILL takes it along;
* a caller with a capability dropped, no-new-privs or another namespace is declined
  (``require``: exit 4 naming what differs; ``auto``: the command runs in-process);
* a module changed on disk since the server started declines and ends the server;
* bad requests cost one waiter, never the server;
* ``agentbox launcher serve`` keeps a front end, restarts it, and stops it.
"""

from __future__ import annotations

import json
import os
import pty
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agentbox.core.wait import socket_accepts, wait_until
from agentbox.linux.cgroups import cgroup_mounts, cgroups_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the front end serves root's commands")

AGENTBOX = [sys.executable, "-m", "agentbox"]


class Front:
    """A fork server for ``data`` (its socket in ``data/run``), run by this test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.work = root / "work"
        self.repos = root / "repos"
        for d in (self.data / "run", self.work, self.repos):
            d.mkdir(parents=True, exist_ok=True)
        (self.data / "run").chmod(0o700)
        self.socket = self.data / "run" / "front.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "front.log"

    def start(self) -> None:
        self._log = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox.front.server", "--socket", str(self.socket),
             "--data-dir", str(self.data), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            start_new_session=True,
        )  # fmt: skip
        proc = self.proc
        wait_until(
            lambda: socket_accepts(self.socket) or proc.poll() is not None,
            timeout=60,
            on_timeout=lambda: AssertionError("the front end never listened"),
        )
        assert proc.poll() is None, self.log.read_text()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kids: list[psutil.Process] = []
            with _gone():
                kids = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.terminate()
            self.proc.wait(10)
            for kid in kids:  # a test that failed half-way may leave a command waiting
                with _gone():
                    kid.kill()
        if self.proc is not None:
            self._log.close()

    def env(self, mode: str, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root"),
            "AGENTBOX_DATA_DIR": str(self.data),
            "AGENTBOX_REPOS_ROOT": str(self.repos),
            "AGENTBOX_FRONT_END": mode,
            **extra,
        }

    def run(
        self, argv: list[str], mode: str, *, stdin: bytes = b"", prefix: list[str] | None = None,
        **extra: str,
    ) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        return subprocess.run(
            [*(prefix or []), *AGENTBOX, *argv], input=stdin, capture_output=True,
            env=self.env(mode, **extra), cwd=self.work, timeout=120,
        )  # fmt: skip

    def command_of(self) -> psutil.Process:
        """The one command being served: a child of a waiter, a child of the server (not
        the pair forked ahead for the next connection: that one still has the server's
        title)."""
        assert self.proc is not None

        def found() -> psutil.Process | None:
            assert self.proc is not None
            for waiter in psutil.Process(self.proc.pid).children():
                with _gone():  # a waiter that just ended
                    for kid in waiter.children():
                        title = " ".join(kid.cmdline())
                        if title and not title.startswith("agentbox front end"):
                            return kid
            return None

        return wait_until(  # generous: a loaded CI host (not a timing assertion)
            found, timeout=120, on_timeout=lambda: AssertionError("no command being served")
        )


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, psutil.NoSuchProcess)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    f = Front(tmp_path)
    f.start()
    try:
        yield f
    finally:
        f.stop()


# -- served == in-process ---------------------------------------------------------------

CASES: dict[str, tuple[list[str], bytes, dict[str, str]]] = {
    "version": (["--version"], b"", {}),
    "json list": (["tasks", "--json"], b"", {}),
    "json error": (["show", "t-nope", "--json"], b"", {}),
    "usage error": (["run", "--repo", "rel/dir"], b"", {}),
    "stdin, cwd, env": (["run", "--repo", "rel/dir", "-"], b"fix it\n", {}),
    "empty stdin": (["run", "--repo", "rel/dir", "-"], b"", {}),
    "forced colour, width": (["--help"], b"", {"FORCE_COLOR": "1", "COLUMNS": "70"}),
    "no colour": (["models", "--help"], b"", {"NO_COLOR": "1", "COLUMNS": "200"}),
    # an ASCII locale the fork takes on with setlocale
    "ASCII locale": (
        ["run", "--repo", "rel/d\u00efr", "-"],
        "fix \u00fc".encode(),
        {"LC_ALL": "C", "PYTHONUTF8": "0"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_served_command_prints_and_exits_as_in_process(front: Front, case: str) -> None:
    argv, stdin, extra = CASES[case]
    served = front.run(argv, "require", stdin=stdin, **extra)
    alone = front.run(argv, "off", stdin=stdin, **extra)
    assert (served.returncode, served.stdout, served.stderr) == (
        alone.returncode,
        alone.stdout,
        alone.stderr,
    )
    if case == "stdin, cwd, env":  # the caller's cwd made the path, its env the root
        assert str(front.work / "rel/dir").encode() in served.stderr
        assert served.returncode == 3


def _under_pty(front: Front, argv: list[str], mode: str) -> tuple[int, bytes]:
    """``agentbox argv`` on a 100x30 terminal: its exit code and everything it printed."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = front.env(mode, TERM="xterm-256color")
    proc = subprocess.Popen(
        [*AGENTBOX, *argv], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=front.work,
        start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            raise AssertionError(f"no output under the terminal: {out!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(30), out


def test_on_a_terminal_a_served_command_has_the_same_colours_and_width(front: Front) -> None:
    served = _under_pty(front, ["run", "--help"], "require")
    alone = _under_pty(front, ["run", "--help"], "off")
    assert served == alone
    assert b"\x1b[" in served[1], "no colour on a terminal"


def test_require_without_a_server_fails_and_runs_nothing(tmp_path: Path) -> None:
    f = Front(tmp_path)  # not started
    res = f.run(["run", "--repo", "rel/dir", "-"], "require", stdin=b"x")
    assert res.returncode == 4
    assert b"AGENTBOX_FRONT_END=require" in res.stderr and b"no front end answers" in res.stderr
    assert b"repo" not in res.stderr  # the command never ran
    assert f.run(["--version"], "auto").returncode == 0  # auto: in-process


@pytest.mark.parametrize(
    ("argv", "own"),
    [
        (["agentbox", "mcp", "--http", "x"], True),
        (["agentbox", "--log-level", "info", "launcher", "serve"], True),
        (["agentbox", "--log-json", "model", "serve", "s.yaml"], True),
        (["agentbox", "launcher", "stop"], False),
        (["agentbox", "run", "--repo", "mcp", "serve"], False),
        (["agentbox", "--log-level", "mcp", "tasks"], False),
    ],
)
def test_services_run_in_their_own_process(argv: list[str], own: bool) -> None:
    from agentbox.front.client import own_process

    assert own_process(argv) is own


def test_a_service_command_is_never_served(front: Front) -> None:
    """``agentbox mcp`` (stdio) with ``require``: it runs as the client's own process (a
    supervisor, a posture check, its privilege drop find it at the pid started)."""
    proc = subprocess.Popen(
        [*AGENTBOX, "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=front.env("require"), cwd=front.work,
    )  # fmt: skip
    try:
        wait_until(  # a served client never loads pydantic: this one is the command
            lambda: "pydantic_core" in Path(f"/proc/{proc.pid}/maps").read_text(),
            timeout=60,
            on_timeout=lambda: AssertionError("the MCP server never started in the client"),
        )
        assert front.proc is not None
        kids = psutil.Process(front.proc.pid).children()
        # Besides the gateway template, the server's children are waiters, each with its
        # command: the pair forked ahead for the next connection keeps the server's title;
        # a served command would carry its caller's command line.
        waiters = [k for k in kids if "agentbox.gateway._template" not in k.cmdline()]
        served = []
        for waiter in waiters:
            with _gone():  # a waiter that just ended
                served += [
                    kid for kid in waiter.children()
                    if not " ".join(kid.cmdline()).startswith("agentbox front end")
                ]  # fmt: skip
        assert served == [], "it was served"
    finally:
        proc.kill()
        proc.communicate()


# -- the caller's process ---------------------------------------------------------------


def _pids_cgroup(tmp_name: str) -> tuple[Path, str] | None:
    """A fresh cgroup in a hierarchy other than the unit's, or None."""
    mounts = cgroup_mounts()
    for key in ("pids", "0"):
        if key in mounts:
            path = mounts[key] / tmp_name
            try:
                path.mkdir()
            except OSError:
                continue
            return path, "/" + tmp_name if key == "pids" else str(Path(cgroups_of("self")["0"]))
    return None


def test_the_command_takes_on_its_callers_process(front: Front) -> None:
    made = _pids_cgroup(f"agentbox-front-test-{os.getpid()}")

    def preexec() -> None:
        if made is not None:
            (made[0] / "cgroup.procs").write_text(str(os.getpid()))
        os.nice(5)
        os.umask(0o027)
        resource.setrlimit(resource.RLIMIT_NOFILE, (777, 888))
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    client = subprocess.Popen(
        [*AGENTBOX, "run", "--repo", "rel/dir", "-"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=front.work,
        env=front.env("require"), preexec_fn=preexec,
    )  # fmt: skip
    try:
        cmd = front.command_of()
        _reading_stdin(cmd.pid)  # set up, and at work
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{cmd.pid}/status").read_text().splitlines()
        )
        assert status["Umask"].strip() == "0027"
        assert status["Threads"].strip() == "1"  # as its own process would be (a privilege drop)
        assert int(status["SigIgn"], 16) >> (signal.SIGQUIT - 1) & 1, "SIGQUIT not ignored"
        assert not int(status["SigIgn"], 16) >> (signal.SIGTERM - 1) & 1
        assert os.getpriority(os.PRIO_PROCESS, cmd.pid) == 5
        assert resource.prlimit(cmd.pid, resource.RLIMIT_NOFILE) == (777, 888)
        assert Path(f"/proc/{cmd.pid}/cwd").resolve() == front.work.resolve()
        title = " ".join(cmd.cmdline())
        assert "agentbox run --repo rel/dir -" in title, title  # ps shows the caller's command
        for fd in (0, 1, 2):  # the very pipes the client holds
            assert (
                os.stat(f"/proc/{cmd.pid}/fd/{fd}").st_ino
                == os.stat(f"/proc/{client.pid}/fd/{fd}").st_ino
            )
        assert cgroups_of(cmd.pid) == cgroups_of(client.pid)
        if made is not None:
            assert made[0].name in Path(f"/proc/{cmd.pid}/cgroup").read_text()
        _, err = client.communicate(b"", timeout=60)  # an empty task: exit 2
        assert client.returncode == 2, err
        assert b"empty" in err
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if made is not None:
            wait_until(lambda: _rmdir(made[0]), timeout=10, on_timeout=lambda: AssertionError(made))


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _reading_stdin(pid: int) -> None:
    """Until ``pid``'s main thread is blocked reading its stdin (``read(0, …)``)."""
    wait_until(
        lambda: Path(f"/proc/{pid}/syscall").read_text().startswith("0 0x0 "),
        timeout=120,
        on_timeout=lambda: AssertionError("the command never read its stdin"),
    )


def _default_signals() -> None:
    """In the client before exec: INT and QUIT as a shell's foreground job has them (a
    suite started in the background ignores both, and an ignored signal stays ignored
    across exec: served or not, the command would then rightly ignore it too)."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _blocked(front: Front, mode: str) -> subprocess.Popen[bytes]:
    """A client whose command waits on its stdin (the task, read from '-')."""
    return subprocess.Popen(
        [*AGENTBOX, "run", "--repo", "rel/dir", "-"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=front.work, env=front.env(mode),
        preexec_fn=_default_signals,
    )  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_reach_the_command_and_it_ends_as_in_process(
    front: Front, sig: signal.Signals
) -> None:
    ends = {}
    for mode in ("require", "off"):
        client = _blocked(front, mode)
        try:
            reader = front.command_of().pid if mode == "require" else client.pid
            _reading_stdin(reader)
            client.send_signal(sig)
            client.wait(120)  # stdin still open: the signal, not an end of input, ends it
            out, err = client.communicate(timeout=60)
        finally:
            if client.poll() is None:
                client.kill()
        ends[mode] = (client.returncode, out, err.replace(b"\r", b""))
    assert ends["require"] == ends["off"]
    assert ends["require"][0] != 0


def test_a_client_killed_takes_its_command_along(front: Front) -> None:
    client = _blocked(front, "require")
    cmd = front.command_of()
    client.kill()
    client.communicate()
    wait_until(
        lambda: not cmd.is_running() or cmd.status() == psutil.STATUS_ZOMBIE,
        timeout=30,
        on_timeout=lambda: AssertionError("the command outlived its killed client"),
    )
    assert socket_accepts(front.socket), "the server went down with a command"


# -- who is served ----------------------------------------------------------------------

FEWER_RIGHTS = {
    # capsh runs bash with what follows --: a script that execs the command
    "a capability dropped": (
        ["capsh", "--drop=cap_sys_boot", "--", "-c", 'exec "$@"', "sh"],
        "CapBnd",
    ),
    "no-new-privs": (["setpriv", "--no-new-privs"], "NoNewPrivs"),
    "another uts namespace": (["unshare", "--uts"], "ns/uts"),
}


@pytest.mark.parametrize("case", list(FEWER_RIGHTS))
def test_a_caller_with_other_rights_is_not_served(front: Front, case: str) -> None:
    prefix, field = FEWER_RIGHTS[case]
    res = front.run(["--version"], "require", prefix=prefix)
    alone = front.run(["--version"], "auto", prefix=prefix)
    assert res.returncode == 4, res.stderr
    assert b"declined" in res.stderr and field.encode() in res.stderr, res.stderr
    assert (alone.returncode, alone.stdout.startswith(b"agentbox ")) == (0, True), alone.stderr


def test_a_caller_in_a_mount_namespace_of_its_own_is_served_with_its_mounts(
    front: Front,
) -> None:
    """As under a unit with PrivateTmp=yes, the other way round: the command joins the
    caller's mount namespace, so it reads a file only the caller's mounts hold."""
    (front.work / "private").mkdir()
    script = 'mount -t tmpfs none private && echo "fix it" > private/task.txt && exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    # an absolute path: one relative to the cwd (the caller's descriptor) would resolve in
    # the caller's mounts even without joining them
    argv = ["run", "--repo", "private", "--task-file", str(front.work / "private/task.txt")]
    served = front.run(argv, "require", prefix=prefix)
    alone = front.run(argv, "off", prefix=prefix)
    assert (served.returncode, served.stdout, served.stderr) == (
        alone.returncode,
        alone.stdout,
        alone.stderr,
    )
    assert served.returncode == 3, served.stderr  # the task was read; the repo is refused
    assert not (front.work / "private" / "task.txt").exists()  # not in the server's mounts


OTHER_PYTHON = {
    "PYTHONPATH": ({"PYTHONPATH": "/nonexistent-agentbox-test"}, b"another Python configuration"),
    "-O": ({"PYTHONOPTIMIZE": "1"}, b"another Python configuration"),
    # LC_ALL=C, yet UTF-8 mode: the fork's setlocale gives ASCII, not the caller's UTF-8
    "UTF-8 mode": ({"LC_ALL": "C", "PYTHONUTF8": "1"}, b"text encoding is utf-8"),
}


@pytest.mark.parametrize("case", list(OTHER_PYTHON))
def test_a_caller_with_another_python_configuration_is_not_served(front: Front, case: str) -> None:
    """What the command would import, or how it would run, differs: not served."""
    extra, said = OTHER_PYTHON[case]
    res = front.run(["--version"], "require", **extra)
    assert res.returncode == 4 and said in res.stderr, res.stderr
    assert front.run(["--version"], "auto", **extra).stdout.startswith(b"agentbox ")


def test_a_changed_module_declines_and_ends_the_server(front: Front) -> None:
    import agentbox.cli._run as module

    path = Path(module.__file__ or "")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        res = front.run(["--version"], "require")
        assert res.returncode == 4
        assert b"changed since the front end started" in res.stderr, res.stderr
        assert front.proc is not None
        assert front.proc.wait(30) is not None  # it ended: its keeper would start a fresh one
        assert front.run(["--version"], "auto").stdout.startswith(b"agentbox ")
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_another_data_dir_is_declined(front: Front, tmp_path: Path) -> None:
    """The client's guess of the socket is a hint: the fork checks the caller's settings."""
    other = tmp_path / "other"
    other.mkdir()
    code = (
        "from agentbox.front.client import run_served, FrontEndUnavailable\n"
        f"try: run_served({str(front.socket)!r}, ['agentbox', '--version'])\n"
        "except FrontEndUnavailable as e: print('declined:', e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**front.env("require"), "AGENTBOX_DATA_DIR": str(other)},
    )  # fmt: skip
    assert "declined:" in res.stdout and "data dir" in res.stdout, res


# -- bad requests -------------------------------------------------------------------------


def _raw(front: Front, send: Callable[[socket.socket], None]) -> dict[str, Any] | None:
    from agentbox.front._wire import WireError, read_message

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(front.socket))
        assert read_message(s) == {"hello": 1}
        send(s)
        try:
            return read_message(s)
        except (OSError, WireError):
            return None


def _frame(doc: Any) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack(">I", len(body)) + body


def _with_fds(n: int) -> Callable[[socket.socket], None]:
    def send(s: socket.socket) -> None:
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
        try:
            socket.send_fds(s, [_frame({"v": 1})], fds)
        finally:
            for fd in fds:
                os.close(fd)

    return send


BAD = {
    "not JSON": lambda s: s.sendall(struct.pack(">I", 5) + b"{nope"),
    "not an object": lambda s: s.sendall(_frame([1, 2])),
    "too long": lambda s: s.sendall(struct.pack(">I", 1 << 30)),
    "cut short": lambda s: (s.sendall(struct.pack(">I", 100) + b"{"), s.shutdown(socket.SHUT_WR)),
    "wrong version": lambda s: s.sendall(_frame({"v": 2})),
    "argv not strings": lambda s: s.sendall(_frame({"v": 1, "argv": [1], "env": {}})),
    "too many fds": _with_fds(5),
    "fds not matching": _with_fds(1),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_declined_and_the_server_serves_on(front: Front, case: str) -> None:
    reply = _raw(front, BAD[case])
    assert reply is None or "declined" in reply, reply
    assert "started" not in (reply or {})
    res = front.run(["--version"], "require")
    assert res.returncode == 0 and res.stdout.startswith(b"agentbox "), res.stderr


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_a_stuck_server_gets_nothing_and_the_command_runs_in_process(
    front: Front, mode: str
) -> None:
    """A server that accepts nothing (here: stopped) is sent nothing: no request, no
    descriptor (held in its queue, a pipe given to it would never see its end). After
    the greeting's timeout the command runs in the client (``require``: exit 4)."""
    assert front.proc is not None
    code = (
        "import sys\n"
        "import agentbox.front.client as c\n"
        "c.HELLO_TIMEOUT = 2.0\n"
        "sys.argv = ['agentbox', 'run', '--repo', 'rel/dir', 'x']\n"
        "c.entry()\n"
    )
    # The server and the waiter pair it forked ahead for the next connection: the group.
    os.killpg(front.proc.pid, signal.SIGSTOP)
    try:
        res = subprocess.run(  # capture_output: it returns only once every pipe end is closed
            [sys.executable, "-c", code], capture_output=True, env=front.env(mode),
            cwd=front.work, timeout=60,
        )  # fmt: skip
    finally:
        os.killpg(front.proc.pid, signal.SIGCONT)
    if mode == "require":
        assert res.returncode == 4 and b"did not greet within 2 s" in res.stderr, res
    else:  # run in-process: the repo's refusal
        assert res.returncode == 3 and b"repo" in res.stderr, res
    assert front.run(["--version"], "require").returncode == 0  # and it serves on


def test_the_command_is_forked_before_its_connection(front: Front) -> None:
    """No fork on a command's start: the server keeps a waiter and its command forked
    ahead, and the next caller's command is that process."""
    assert front.proc is not None

    def spares(but: int = 0) -> set[int] | None:
        """The commands forked ahead (each a waiter's child; more than one pair may be
        ahead when callers came close together: any of them may take the next one)."""
        assert front.proc is not None
        found = set()
        for waiter in psutil.Process(front.proc.pid).children():
            with _gone():
                for kid in waiter.children():
                    if kid.pid != but and kid.status() != psutil.STATUS_ZOMBIE:
                        found.add(kid.pid)
        return found or None

    ahead = wait_until(spares, timeout=60, on_timeout=lambda: AssertionError("no pair ahead"))
    client = _blocked(front, "require")
    try:
        command = front.command_of().pid
        assert command in ahead, "the command was forked after its connection"
        nxt = wait_until(
            lambda: spares(but=command),
            timeout=60,
            on_timeout=lambda: AssertionError("no pair forked for the next caller"),
        )
        assert command not in nxt
        client.communicate(b"", timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode != 0  # the empty task refused, as in-process


def test_a_silent_client_costs_one_waiter(front: Front) -> None:
    with socket.socket(socket.AF_UNIX) as idle:
        idle.connect(str(front.socket))  # says nothing
        res = front.run(["--version"], "require")
        assert res.returncode == 0, res.stderr


# -- kept by the launcher service ---------------------------------------------------------


def test_launcher_serve_keeps_a_front_end(tmp_path: Path) -> None:
    f = Front(tmp_path)
    log = (tmp_path / "serve.log").open("wb")
    svc = subprocess.Popen(
        [*AGENTBOX, "launcher", "serve"], env=f.env("auto"), stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: socket_accepts(f.socket) or svc.poll() is not None,
            timeout=90,
            on_timeout=lambda: AssertionError((tmp_path / "serve.log").read_text()),
        )
        assert svc.poll() is None, (tmp_path / "serve.log").read_text()
        served = f.run(["tasks", "--json"], "require")
        assert served.returncode == 0 and json.loads(served.stdout) == {"tasks": []}

        def server() -> psutil.Process | None:
            for kid in psutil.Process(svc.pid).children():
                if f"agentbox front end {f.socket}" in " ".join(kid.cmdline()):
                    return kid
            return None

        first = wait_until(server, timeout=10, on_timeout=lambda: AssertionError("no server"))
        first.kill()  # a crash: the keeper starts it again
        again = wait_until(
            lambda: (s := server()) is not None and s.pid != first.pid and socket_accepts(f.socket),
            timeout=60,
            on_timeout=lambda: AssertionError("the front end was not started again"),
        )
        assert again
        assert f.run(["--version"], "require").returncode == 0
        svc.terminate()
        svc.wait(60)
        assert not f.socket.exists(), "the front end's socket outlived the service"
        wait_until(
            lambda: (
                not any(
                    f"agentbox front end {f.socket}" in " ".join(p.info["cmdline"] or [])
                    and str(f.socket) in " ".join(p.info["cmdline"] or [])
                    for p in psutil.process_iter(["cmdline"])
                )
            ),
            timeout=30,
            on_timeout=lambda: AssertionError("the front end outlived the service"),
        )
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        log.close()


def test_launcher_serve_with_the_front_end_off_starts_none(tmp_path: Path) -> None:
    f = Front(tmp_path)
    env = {**f.env("off")}
    svc = subprocess.Popen(
        [*AGENTBOX, "launcher", "serve"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        launcher_sock = f.data / "run" / "launcher.sock"
        wait_until(
            lambda: socket_accepts(launcher_sock) or svc.poll() is not None,
            timeout=90,
            on_timeout=lambda: AssertionError("the launcher never listened"),
        )
        assert svc.poll() is None
        # The server would start START_DELAY s after the service, then import (~1.5 s):
        # watch past both, or this could not fail.
        from agentbox.launcher._front import START_DELAY

        end = time.monotonic() + START_DELAY + 15
        while time.monotonic() < end:
            assert not f.socket.exists(), "a front end was started"
            assert not psutil.Process(svc.pid).children(), "a front end was started"
            time.sleep(0.2)
        assert svc.poll() is None
    finally:
        svc.terminate()
        svc.wait(60)
