"""The backend Protocol's contract, run on every registered backend, under each of its
runtimes.

The cases come from the registry (:mod:`agentbox.backends.registry`): a backend added
there is run here with no edit. Each case carries its backend's marker (a host without
the backend skips it with the probed reason; ``AGENTBOX_REQUIRE`` makes that an error),
and a runtime this host cannot use is skipped with its reason. Every backend must pass
the same tests: one-shot run with exit code and separate streams, deadlines,
create/exec/env/stdin, copy in and out without following links out, posture, idempotent
destroy, and the gateway path (127.0.0.1:GATEWAY_PORT inside reaching
``gateway_dir/gateway.sock`` on the host).

"Nothing survived" is part of the contract: every sandbox here is made through
a :class:`~sandbox_leaks.SandboxTracker` (the ``sandbox_factory`` fixture of
``conftest.py``), which asserts after each test that no process, cgroup,
container, VM dir, socket or env fd of it remains, and saves its posture and
logs when a test fails.
"""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends import backend_class, get_backend, registry
from agentbox.backends.base import (
    GATEWAY_PORT,
    GATEWAY_SOCKET_NAME,
    Backend,
    Sandbox,
    SandboxSpec,
)
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.errors import AgentboxError
from agentbox.observe.resources import Cgroup, conmon_child
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

#: Every case boots the default image, which is built in podman's storage.
pytestmark = pytest.mark.podman


def _cases() -> list[Any]:
    """(backend, runtime) for every registered backend a user may choose, each runtime of
    its ``runtimes`` trait (or none), marked with the backend's facility marker."""
    cases = []
    for r in registry.REGISTERED:
        if not r.selectable:
            continue  # the fake runs no sandbox: tests/unit covers it
        mark = getattr(pytest.mark, r.name)
        for rt in backend_class(r.name).runtimes or (None,):
            ident = f"{r.name}-{rt}" if rt else r.name
            cases.append(pytest.param((r.name, rt), id=ident, marks=mark))
    return cases


CASES = _cases()


def _runtime_refused(name: str, runtime: str | None) -> str | None:
    """Why this host cannot run ``runtime`` under backend ``name`` (None: it can). Docker's
    facility (its marker) already requires both its runtimes; podman's are probed one by one."""
    if runtime is None or name != "podman":
        return None
    fac = _host.podman_runtime(runtime)
    return None if fac.ok else f"{fac.name}: {fac.detail} (fix: {fac.fix})"


class Case:
    """One backend under test: makes specs for it."""

    def __init__(self, backend: Backend, settings: Settings, runtime: str | None) -> None:
        self.backend = backend
        self.settings = settings
        self.runtime = runtime

    def spec(self, **kw: object) -> SandboxSpec:
        fields: dict[str, object] = {"backend": self.backend.name}
        if self.runtime:
            fields["runtime"] = self.runtime
        fields.update({k: v for k, v in kw.items() if k in Boxfile.model_fields})
        extra = {k: v for k, v in kw.items() if k not in Boxfile.model_fields}
        return spec_from_boxfile(Boxfile.from_dict(fields), self.settings, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=CASES)
def case(
    request: pytest.FixtureRequest,
    default_image: str,
    settings_factory: Callable[[], Settings],
) -> Case:
    name, runtime = request.param
    settings = settings_factory()
    refused = _runtime_refused(name, runtime)
    if refused:
        pytest.skip(refused)
    return Case(get_backend(name, settings), settings, runtime)


@pytest.fixture
def sandboxes(
    case: Case, sandbox_factory: Callable[[Backend, Settings], SandboxTracker]
) -> SandboxTracker:
    """This test's sandboxes of the backend; checked for survivors after the test."""
    return sandbox_factory(case.backend, case.settings)


@pytest.fixture(scope="module")
def live(case: Case, workspace_factory: Callable[[Settings], Path]) -> Iterator[Sandbox]:
    """One sandbox per backend, shared by the exec/copy/posture tests of this module;
    checked for survivors once the module is done with it."""
    spec = case.spec(workspace=workspace_factory(case.settings))
    case.backend.check(spec)
    tracker = SandboxTracker(case.backend, case.settings)
    box = tracker.create(spec)
    try:
        yield box
        box.destroy()
        tracker.assert_clean()
    finally:
        tracker.close()


def test_run_exit_code_and_separate_streams(case: Case, sandboxes: SandboxTracker) -> None:
    spec = case.spec()
    res = sandboxes.run(spec, ["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (7, b"out\n", b"err\n", False)


def test_run_streams_to_callbacks(case: Case, sandboxes: SandboxTracker) -> None:
    chunks: list[bytes] = []
    res = sandboxes.run(
        case.spec(), ["sh", "-c", "echo one; echo two"], on_stdout=chunks.append, stdin=None
    )
    assert res.exit_code == 0 and res.stdout == b""
    assert b"".join(chunks) == b"one\ntwo\n"


def test_run_stdin(case: Case, sandboxes: SandboxTracker) -> None:
    res = sandboxes.run(case.spec(), ["wc", "-c"], stdin=b"x" * 1000)
    assert res.stdout.strip() == b"1000"


def test_run_deadline_kills_and_says_so(case: Case, sandboxes: SandboxTracker) -> None:
    res = sandboxes.run(case.spec(deadline=1.5), ["sleep", "60"])
    assert res.timed_out
    assert res.exit_code != 0


def test_exec_env_stdin_and_workdir(live: Sandbox) -> None:
    res = live.exec(["sh", "-c", "pwd; id -u; echo $FOO; cat"], env={"FOO": "bar"}, stdin=b"in")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.decode().split("\n") == ["/workspace", "64000", "bar", "in"]


def test_exec_timeout(live: Sandbox) -> None:
    res = live.exec(["sleep", "30"], timeout=1)
    assert res.timed_out
    assert live.exec(["true"]).exit_code == 0  # the sandbox survives


def test_copy_roundtrip(live: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("hello\n")
    live.copy_in(src, "/workspace/copied")
    # Python's stat, not coreutils': gVisor 2022-12 answers coreutils' statx with EINVAL here.
    probe = "import os; print(open('/workspace/copied/sub/f.txt').read().strip(), "
    probe += "os.stat('/workspace/copied').st_uid)"
    res = live.exec(["python3", "-c", probe])
    assert res.stdout.decode().split() == ["hello", "64000"], res.stderr
    live.exec(["sh", "-c", "echo new > /workspace/copied/sub/g.txt"])
    live.copy_out("/workspace/copied", tmp_path / "out")
    assert (tmp_path / "out/sub/g.txt").read_text() == "new\n"


def test_copy_out_never_follows_links_out(live: Sandbox, tmp_path: Path) -> None:
    script = (
        "mkdir -p /tmp/evil && echo inner > /tmp/evil/ok && "
        "ln -sf /etc/shadow /tmp/evil/abs && ln -sf ../../../../etc/passwd /tmp/evil/rel && "
        "ln -sfn / /tmp/evil/root"
    )
    assert live.exec(["sh", "-c", script]).exit_code == 0
    live.copy_out("/tmp/evil", tmp_path / "evil")
    out = tmp_path / "evil"
    assert (out / "ok").read_text() == "inner\n"
    for name in ("abs", "rel", "root"):
        p = out / name
        # Either dropped, or a link whose target stays inside the copy: never host data.
        if p.is_symlink():
            assert out.resolve() in p.resolve().parents or p.resolve() == out.resolve()
        assert not (p.exists() and p.resolve() in (Path("/etc/shadow"), Path("/etc/passwd")))


def test_posture_is_ok(live: Sandbox) -> None:
    posture = live.posture()
    failed = [c for c in posture.checks if not c.ok]
    assert posture.ok, failed
    assert {c.where for c in posture.checks} == {"inside", "host"}


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        reply = json.dumps({"path": self.path, "len": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[object, tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("sandbox", 0)  # BaseHTTPRequestHandler wants a (host, port)


CLIENT = r"""
import json, sys, threading, urllib.request
N = int(sys.argv[1]); res = {}
def one(i):
    body = b"x" * (i * 100000)
    req = urllib.request.Request(f"http://127.0.0.1:PORT/r/{i}", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=20) as r:
        res[str(i)] = json.loads(r.read())
def half_close():
    import socket
    s = socket.create_connection(("127.0.0.1", PORT), timeout=20)
    s.sendall(b"POST /half HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc")
    s.shutdown(socket.SHUT_WR)  # the reply must still come back through the relay
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    res["half"] = json.loads(data.split(b"\r\n\r\n", 1)[1])
ts = [threading.Thread(target=one, args=(i,)) for i in range(N)]
ts.append(threading.Thread(target=half_close))
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(res, sort_keys=True))
""".replace("PORT", str(GATEWAY_PORT))


@pytest.fixture
def gateway_dir(case: Case) -> Iterator[Path]:
    gw = Path(tempfile.mkdtemp(prefix="gw-", dir=case.settings.data_dir))
    gw.chmod(0o755)
    server = _UnixHTTPServer(str(gw / GATEWAY_SOCKET_NAME), _Handler)
    (gw / GATEWAY_SOCKET_NAME).chmod(0o666)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield gw
    finally:
        server.shutdown()
        server.server_close()


def _check_replies(stdout: bytes, n: int) -> None:
    got = json.loads(stdout)
    want: dict[str, object] = {str(i): {"path": f"/r/{i}", "len": i * 100000} for i in range(n)}
    want["half"] = {"path": "/half", "len": 3}
    assert got == want


def test_gateway_reachable_from_run(
    case: Case, gateway_dir: Path, sandboxes: SandboxTracker
) -> None:
    res = sandboxes.run(case.spec(gateway_dir=gateway_dir), ["python3", "-c", CLIENT, "6"])
    assert res.exit_code == 0, res.stderr
    _check_replies(res.stdout, 6)


def test_gateway_reachable_from_exec(
    case: Case,
    gateway_dir: Path,
    workspace_factory: Callable[[Settings], Path],
    sandboxes: SandboxTracker,
) -> None:
    spec = case.spec(gateway_dir=gateway_dir, workspace=workspace_factory(case.settings))
    with sandboxes.create(spec) as box:
        res = box.exec(["python3", "-c", CLIENT, "8"], timeout=60)
        assert res.exit_code == 0, res.stderr
        _check_replies(res.stdout, 8)


def test_destroy_is_idempotent(case: Case, sandboxes: SandboxTracker) -> None:
    box = sandboxes.create(case.spec())
    pids = box.host_pids()
    assert pids, "a live sandbox has host processes"
    box.destroy()
    box.destroy()
    sandboxes.assert_clean()  # at once, not only at teardown
    with pytest.raises(AgentboxError):
        box.exec(["true"])


def test_the_resource_sampler_finds_the_sandboxs_cgroup_without_the_engine(
    case: Case, live: Sandbox
) -> None:
    """podman: the sampler finds the container's init from its conmon in /proc (no
    ``podman inspect``, whose container lock a loaded host's start holds): the cgroup
    it finds is the one the engine reports."""
    if case.backend.name != "podman":
        pytest.skip("the /proc search is podman's (conmon); other engines are inspected")
    res = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Pid}}", live.name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    engine = Cgroup.of_pid(int(res.stdout))
    init = conmon_child(live.name)
    assert init is not None, f"no conmon child found for {live.name}"
    assert engine is not None and Cgroup.of_pid(init) == engine
    assert engine.memory is not None and Cgroup.of_pid(os.getpid()) != engine
