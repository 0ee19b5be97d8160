"""Gateways forked from the template (``gateway_template``) against exec'd ones.

Real processes, read from ``/proc``: a forked gateway has an exec'd one's posture
(uid, capabilities, no_new_privs, seccomp, RLIMIT_AS, its descriptors, its command
line, what re-adoption checks), two forked gateways share no descriptor and no
writable shared mapping, and a forked gateway outlives its template. The fallback:
a template that cannot start leaves spawn_gateway exec'ing the gateway.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import re
import resource
import secrets
import signal
import socket
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import GatewayError
from agentbox.escape._hostcheck import gateway_posture
from agentbox.gateway import GatewayHandle, _forkspawn, gateway_identity, spawn_gateway
from agentbox.gateway._forkspawn import ForkedProcess
from agentbox.gateway._template import set_cmdline
from agentbox.launcher._adopt import gateway_refusal
from agentbox.launcher._names import list_task_gateways
from agentbox.launcher._store import Owner
from agentbox.linux.privdrop import process_posture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the gateway drops from root only")


@pytest.fixture
def fresh_template() -> Iterator[None]:
    """Each test starts its own template and stops it after (its gateways are stopped)."""
    _forkspawn.stop_template()
    yield
    _forkspawn.stop_template()


def _spawn(settings: Settings, task_id: str, *, forked: bool) -> GatewayHandle:
    """A gateway for ``task_id`` laid out as the launcher lays out a task's."""
    paths = TaskPaths(settings.data_dir, task_id)
    paths.root.parent.mkdir(exist_ok=True, mode=0o700)
    paths.root.mkdir(parents=True, mode=0o700)
    paths.gateway_dir.mkdir(mode=0o755)
    paths.log_dir.mkdir(mode=0o700)
    token = paths.root / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    return spawn_gateway(
        socket_path=paths.gateway_socket,
        token_file=token,
        model="replay-demo",
        budget=10**6,
        usage_file=paths.usage_file,
        settings=settings.model_copy(update={"gateway_template": forked}),
        log_file=paths.log_dir / "gateway.log",
        run_as=gateway_identity(settings),
        exit_at=time.time() + 300,
    )


def _fds(pid: int) -> dict[int, str]:
    """The process's open descriptors and what each names (one closed between the listing
    and its readlink is left out: a serving gateway opens and closes its own)."""
    out = {}
    for n in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            out[int(n.name)] = os.readlink(n)
    return out


def _fd_kinds(pid: int, task_root: Path) -> list[str]:
    """What a process holds open, with the task's paths and kernel object ids masked."""
    kinds = []
    for target in _fds(pid).values():
        target = target.replace(str(task_root), "TASK")
        kinds.append(re.sub(r"\[\d+\]", "[N]", target))
    return sorted(kinds)


def _argv(pid: int) -> list[bytes]:
    """Its command line less the values that differ by start (ready fd, exit time)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for opt in (b"--ready-fd", b"--exit-at"):
        i = argv.index(opt)
        del argv[i : i + 2]
    return argv


def _seccomp(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Seccomp:"):
            return line.split()[1]
    return ""


def _limits(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/limits").read_text().splitlines()


def test_forked_gateway_has_the_exec_posture(settings: Settings, fresh_template: None) -> None:
    with (
        _spawn(settings, "exec1", forked=False) as execd,
        _spawn(settings, "fork1", forked=True) as forked,
    ):
        assert isinstance(forked._proc, ForkedProcess)  # really forked, not the fallback
        assert not isinstance(execd._proc, ForkedProcess)
        identity = gateway_identity(settings)
        assert identity is not None
        for gw in (execd, forked):
            checks = gateway_posture(gw.pid, want_uid=identity[0])
            assert all(ok for _, ok, _ in checks), checks
        assert process_posture(forked.pid) == process_posture(execd.pid)
        assert _seccomp(forked.pid) == _seccomp(execd.pid) == "2"
        assert _limits(forked.pid) == _limits(execd.pid)
        tasks = settings.data_dir / "tasks"
        # Each closes its ready pipe just after writing to it: allow for that moment.
        for _ in range(200):
            fork_fds = _fd_kinds(forked.pid, tasks / "fork1")
            exec_fds = _fd_kinds(execd.pid, tasks / "exec1")
            if fork_fds == exec_fds:
                break
            time.sleep(0.01)
        assert fork_fds == exec_fds
        assert not any(k.startswith("pipe:") for k in fork_fds)
        # Named as the exec'd gateway: the argv differs only in the task's own paths.
        exec_argv = _argv(execd.pid)
        fork_argv = _argv(forked.pid)
        assert [a.replace(b"exec1", b"fork1") for a in exec_argv] == fork_argv
        assert Path(f"/proc/{forked.pid}/comm").read_text().strip() == "agentbox-gw"
        # Its own session and group, as start_new_session gives an exec'd one.
        assert os.getsid(forked.pid) == os.getpgid(forked.pid) == forked.pid
        # Re-adoption and the orphan sweep see it as this task's gateway.
        paths = TaskPaths(settings.data_dir, "fork1")
        owner = Owner.of(forked.pid)
        assert owner is not None and gateway_refusal(owner, paths) is None
        other = TaskPaths(settings.data_dir, "exec1")
        assert gateway_refusal(owner, other) is not None  # a control
        found = dict(list_task_gateways(settings))
        assert found["fork1"].pid == forked.pid and found["exec1"].pid == execd.pid
    assert not forked.alive() and not execd.alive()


def test_two_forked_gateways_share_no_writable_state(
    settings: Settings, fresh_template: None
) -> None:
    with (
        _spawn(settings, "a", forked=True) as one,
        _spawn(settings, "b", forked=True) as two,
    ):
        assert isinstance(one._proc, ForkedProcess) and isinstance(two._proc, ForkedProcess)
        template = _forkspawn._current
        assert template is not None

        # No open file description in common (kcmp compares them across processes).
        assert not _shared_files(one.pid, two.pid)
        assert not _shared_files(one.pid, template.proc.pid)
        assert not _shared_files(two.pid, template.proc.pid)
        # A control: a process shares its descriptions with itself.
        assert _shared_files(one.pid, one.pid)
        for pid in (one.pid, two.pid):
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            # A writable mapping shared with another process would be "rw-s".
            perms = [(m.split()[1], m) for m in maps]
            writable_shared = [m for p, m in perms if p[1] == "w" and p[3] == "s"]
            assert not writable_shared, writable_shared
        # The template holds nothing of a task: no socket but its own to the launcher.
        held = [t for t in _fds(template.proc.pid).values() if t.startswith("socket:")]
        assert len(held) == 1, held
        assert len(list(Path(f"/proc/{template.proc.pid}/task").iterdir())) == 1  # no thread


_SYS_KCMP = 312  # x86_64
_KCMP_FILE = 0


def _shared_files(a: int, b: int) -> list[tuple[int, int]]:
    """Pairs of descriptors of ``a`` and ``b`` that are the same open file description."""
    if platform.machine() != "x86_64":
        pytest.skip("kcmp's number is known here for x86_64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    same = []
    for fa in _fds(a):
        for fb in _fds(b):
            rc = libc.syscall(_SYS_KCMP, a, b, _KCMP_FILE, fa, fb)
            if rc == 0:
                same.append((fa, fb))
            elif rc < 0 and ctypes.get_errno() not in (errno.EBADF,):
                raise OSError(ctypes.get_errno(), "kcmp")
    return same


def _ask(sock_path: Path) -> bytes:
    """One unauthenticated request: any HTTP answer proves the gateway serves."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    return got


def test_forked_gateway_outlives_its_template(settings: Settings, fresh_template: None) -> None:
    with _spawn(settings, "t1", forked=True) as gw:
        template = _forkspawn._current
        assert template is not None and isinstance(gw._proc, ForkedProcess)
        first = template.proc.pid
        os.kill(first, signal.SIGKILL)
        template.proc.wait(10)
        assert _ask(gw.socket_path).startswith(b"HTTP/1.1 ")
        assert gw.alive()
        # The next gateway asked for starts another template.
        with _spawn(settings, "t2", forked=True) as again:
            assert isinstance(again._proc, ForkedProcess)
            assert _forkspawn._current is not None and _forkspawn._current.proc.pid != first
            assert _ask(again.socket_path).startswith(b"HTTP/1.1 ")
        assert gw.alive()  # one gateway's stop is not another's
    assert not gw.alive()


def test_spawn_falls_back_to_exec_when_the_template_fails(
    settings: Settings, fresh_template: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*a: object, **kw: object) -> object:
        raise GatewayError("the gateway template did not start: b'test'")

    monkeypatch.setattr(_forkspawn.Template, "start", refuse)
    monkeypatch.setattr(_forkspawn, "_failed_at", 0.0)
    with _spawn(settings, "fb", forked=True) as gw:
        assert not isinstance(gw._proc, ForkedProcess)  # exec'd
        assert _ask(gw.socket_path).startswith(b"HTTP/1.1 ")


def test_set_cmdline_names_this_process() -> None:
    """The primitive a forked gateway names itself with, in a throwaway child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            set_cmdline(["python", "-m", "agentbox.gateway", "--listen", "unix:/x"])
            os.write(w, Path("/proc/self/cmdline").read_bytes())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got == b"python\0-m\0agentbox.gateway\0--listen\0unix:/x\0"


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_a_channel_forks_from_the_template_that_gave_it(
    settings: Settings, fresh_template: None
) -> None:
    """A channel (what the front end's server gives each command it forks) forks gateways
    from the template that gave it, with the posture of one forked on the template's own
    socket; the template outlives the end it was started with while a channel is open, and
    ends once every one has closed."""
    from agentbox.gateway._process import start_template

    template = start_template()
    try:
        channel = template.channel()
        other = template.channel()
        other.close()
        root_pid = template.proc.pid
        _forkspawn.adopt_channel(channel)
        with _spawn(settings, "ch1", forked=True) as gw:
            assert isinstance(gw._proc, ForkedProcess)
            assert _ppid(gw.pid) == root_pid  # forked there, not from a template of its own
            identity = gateway_identity(settings)
            assert identity is not None
            checks = gateway_posture(gw.pid, want_uid=identity[0])
            assert all(ok for _, ok, _ in checks), checks
            assert _ask(gw.socket_path).startswith(b"HTTP/1.1 ")
            # The end the template was started with closes: the channel still serves.
            template._sock.close()
            time.sleep(0.2)
            assert template.proc.poll() is None
            with _spawn(settings, "ch2", forked=True) as again:
                assert isinstance(again._proc, ForkedProcess)
                assert _ppid(again.pid) == root_pid
        _forkspawn.stop_template()  # closes the last channel: the template ends
        template.proc.wait(10)
    finally:
        template.close()


# -- a requester whose posture is not the template's ------------------------------------


def _posture_of(pid: int) -> dict[str, object]:
    """What a gateway inherits from whoever starts it, read from ``/proc``."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {
        "nice": int(stat[16]),  # proc(5) field 19
        "cpus": status["Cpus_allowed_list"].strip(),
        "umask": status["Umask"].strip(),
        "oom_score_adj": Path(f"/proc/{pid}/oom_score_adj").read_text().strip(),
        "limits": _limits(pid),
        "mnt": os.readlink(f"/proc/{pid}/ns/mnt"),
    }


def _unshare_mounts() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS (nothing mounted: the same root)
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")


def _in_a_child(settings: Settings, setup: str) -> dict[str, object]:
    """In a fork of this process, which then differs from the template in ``setup``
    (``"differs"``: nice +3, one CPU, umask 027, NOFILE and CORE limits, OOM score +100,
    a mount namespace of its own; ``"above"``: a nice value below the template's),
    spawn a forked and an exec'd gateway; their postures and how each was started. The
    fork asks this process's template through a channel of its own, as a command the
    front end forked does."""
    template = _forkspawn._current
    assert template is not None
    channel = template.channel()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            _forkspawn._current = None  # the parent's (its process is not this one's child)
            _forkspawn.adopt_channel(channel)
            if setup == "differs":
                os.nice(3)
                os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
                os.umask(0o027)
                resource.setrlimit(resource.RLIMIT_NOFILE, (777, 888))
                resource.setrlimit(resource.RLIMIT_CORE, (4096, 8192))
                adj = int(Path("/proc/self/oom_score_adj").read_text())
                Path("/proc/self/oom_score_adj").write_text(str(min(1000, adj + 100)))
                _unshare_mounts()
            else:
                os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)
            out: dict[str, object] = {"caller": _posture_of(os.getpid())}
            with (
                _spawn(settings, f"{setup}-x", forked=False) as execd,
                _spawn(settings, f"{setup}-f", forked=True) as forked,
            ):
                assert _ask(forked.socket_path).startswith(b"HTTP/1.1 ")
                out["exec"], out["fork"] = _posture_of(execd.pid), _posture_of(forked.pid)
                out["forked"] = isinstance(forked._proc, ForkedProcess)
                out["ppid"] = _ppid(forked.pid)
                identity = gateway_identity(settings)
                assert identity is not None
                checks = gateway_posture(forked.pid, want_uid=identity[0])
                out["checks"] = [ok for _, ok, _ in checks]
                out["same_rights"] = process_posture(forked.pid) == process_posture(execd.pid)
            os.write(w, json.dumps(out).encode())
            code = 0
        except BaseException:
            os.write(w, json.dumps({"error": traceback.format_exc()}).encode())
        finally:
            os._exit(code)
    os.close(w)
    channel.close()
    got = b""
    while chunk := os.read(r, 65536):
        got += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    doc: dict[str, object] = json.loads(got)
    assert os.waitstatus_to_exitcode(status) == 0, doc.get("error")
    return doc


def test_forked_gateway_takes_on_a_differing_requesters_posture(
    settings: Settings, fresh_template: None
) -> None:
    """A requester whose nice value, affinity, umask, limits, OOM score adjustment and
    mount namespace are not the template's (a served ``agentbox run`` from a user's
    shell, a template started by a systemd unit): its forked gateway has what an exec'd
    gateway started by that requester has, read from /proc, and is still forked."""
    with _spawn(settings, "first", forked=True) as gw:  # the template, in our posture
        assert isinstance(gw._proc, ForkedProcess)
    template = _forkspawn._current
    assert template is not None and template.proc is not None
    got = _in_a_child(settings, "differs")
    assert got["forked"] is True and got["ppid"] == template.proc.pid
    caller, execd, forked = got["caller"], got["exec"], got["fork"]
    assert isinstance(caller, dict) and isinstance(execd, dict) and isinstance(forked, dict)
    assert forked == execd
    mine = _posture_of(template.proc.pid)
    for key in ("nice", "umask", "oom_score_adj", "mnt"):  # the case: each differs
        assert caller[key] != mine[key] and forked[key] == caller[key], key
    if len(os.sched_getaffinity(0)) > 1:
        assert caller["cpus"] != mine["cpus"] and forked["cpus"] == caller["cpus"]
    assert any("open files" in line and "777" in line for line in forked["limits"])
    assert got["same_rights"] is True and all(got["checks"])


def test_template_refuses_more_than_its_own_and_the_gateway_is_execd(
    settings: Settings, fresh_template: None
) -> None:
    """A requester at a higher priority than the template (nice below): the template
    does not give it (it gives no more than it has), and the gateway is exec'd, with the
    requester's nice value."""
    with _spawn(settings, "first", forked=True):
        pass
    got = _in_a_child(settings, "above")
    assert got["forked"] is False
    caller, execd, forked = got["caller"], got["exec"], got["fork"]
    assert isinstance(caller, dict) and isinstance(execd, dict) and isinstance(forked, dict)
    assert forked["nice"] == execd["nice"] == caller["nice"]


def test_a_mount_namespace_of_another_user_namespace_is_refused() -> None:
    """A sandbox's mount namespace (owned by a user namespace of its own) is never joined."""
    import shutil
    import subprocess

    from agentbox.gateway._template import _mount_ns

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    proc = subprocess.Popen(
        ["unshare", "--user", "--mount", "sleep", "60"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        fd = -1
        for _ in range(1000):  # until it has unshared (bounded: tens of seconds at most)
            mine = os.readlink("/proc/self/ns/user")
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/user") != mine and (
                    os.readlink(f"/proc/{proc.pid}/exe").endswith("sleep")
                ):
                    fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY)
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.skip("unshare --user failed here")
            time.sleep(0.02)
        assert fd >= 0, "unshare never ran sleep in a user namespace of its own"
        try:
            with pytest.raises(ValueError, match=r"another user namespace's|not ours"):
                _mount_ns(fd)
        finally:
            os.close(fd)
    finally:
        proc.kill()
        proc.wait()
