"""The qemu backend against a real QEMU (TCG here) and the real default image.

One restored sandbox is shared by the session (boots are seconds under TCG);
tests that need their own VM (cold boot, deadline, a dead guest) make one. Every
sandbox is made through a :class:`~sandbox_leaks.SandboxTracker` (``sandbox_factory``
for a test's own, ``module_sandbox_factory`` for the shared one): nothing of it may
survive its end.
"""

from __future__ import annotations

import os
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import ExecResult, SandboxSpec
from agentbox.backends.microvm._guest import KernelFacts
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.errors import GuestError
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

RES = Resources(memory="1GiB", cpus=1)


@pytest.fixture(scope="session")
def qemu_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    data = tmp_path_factory.mktemp("qemu-data")
    return Settings(data_dir=data)


@pytest.fixture(scope="session")
def qemu_rootfs() -> tuple[Path, str]:
    """The default image's kept root (built once, cached by hash)."""
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    return info.rootfs, info.hash


@pytest.fixture(scope="session")
def qemu_backend(qemu_settings: Settings, qemu_rootfs: tuple[Path, str]) -> QemuBackend:
    return QemuBackend(qemu_settings, rootfs=qemu_rootfs)


@pytest.fixture
def tracker(
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
    qemu_backend: QemuBackend,
    qemu_settings: Settings,
) -> SandboxTracker:
    """The test's sandboxes of the shared backend, checked for leftovers after it."""
    return sandbox_factory(qemu_backend, qemu_settings)


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(4096)
        time.sleep(0.2)  # overlap the concurrent connections
        self.wfile.write(b"echo:" + line)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture(scope="session")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("gw")
    srv = _Server(str(d / "gateway.sock"), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield d
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("ws")
    (ws / "README").write_text("hello from the host\n")
    (ws / "sub").mkdir()
    (ws / "sub/data.bin").write_bytes(os.urandom(300_000))
    return ws


@pytest.fixture(scope="module")
def vm(
    qemu_backend: QemuBackend,
    workspace: Path,
    gateway_dir: Path,
    module_sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> Iterator[QemuSandbox]:
    spec = SandboxSpec(
        name="qemu-session", image="default", resources=RES, workspace=workspace,
        gateway_dir=gateway_dir, env={"FROM_SPEC": "1"},
    )  # fmt: skip
    sb = module_sandbox_factory(qemu_backend, qemu_backend.settings).create(spec)
    assert isinstance(sb, QemuSandbox)
    yield sb
    sb.destroy()
    assert not sb.vm_dir.exists()
    assert not sb.vm.alive()


def test_exec_streams_output_and_exit_code(vm: QemuSandbox) -> None:
    res = vm.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (res.exit_code, res.stdout, res.stderr) == (7, b"out\n", b"err\n")
    chunks: list[bytes] = []
    res = vm.exec(["sh", "-c", "for i in 1 2 3; do echo $i; done"], on_stdout=chunks.append)
    assert b"".join(chunks) == b"1\n2\n3\n" and res.stdout == b""


def test_exec_identity_env_stdin_and_workdir(vm: QemuSandbox) -> None:
    res = vm.exec(
        ["sh", "-c", 'id -u; echo "$FROM_SPEC$EXTRA"; pwd; cat'], env={"EXTRA": "x"}, stdin=b"in"
    )
    assert res.stdout == b"64000\n1x\n/workspace\nin"


def test_workload_has_no_privileges_in_the_guest(vm: QemuSandbox) -> None:
    res = vm.exec(["sh", "-c", "grep -E '^(CapEff|NoNewPrivs|Groups):' /proc/self/status"])
    fields = {k: v.strip() for k, v in (ln.split(":") for ln in res.stdout.decode().splitlines())}
    assert fields == {"CapEff": "0000000000000000", "NoNewPrivs": "1", "Groups": ""}


def test_workload_limits_in_the_guest(vm: QemuSandbox) -> None:
    probe = "import resource as r; print(r.getrlimit(r.RLIMIT_NPROC)[0], "
    probe += "r.getrlimit(r.RLIMIT_NOFILE)[0])"
    res = vm.exec(["python3", "-c", probe])
    assert res.stdout.split() == [str(RES.pids).encode(), str(RES.nofile).encode()]


def test_guest_runs_its_own_kernel(vm: QemuSandbox) -> None:
    res = vm.exec(["uname", "-r"])
    assert res.stdout.decode().strip() != os.uname().release
    assert res.stdout.decode().startswith("6.1.")


def test_every_command_is_preceded_by_a_check(
    vm: QemuSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert vm.session is not None
    sent: list[str] = []
    orig = vm.session.channel.send_ctrl

    def spy(msg: dict[str, object], stream: int = 0) -> None:
        sent.append(str(msg["op"]))
        orig(msg, stream)

    monkeypatch.setattr(vm.session.channel, "send_ctrl", spy)
    vm.exec(["true"])
    vm.exec(["true"])
    assert sent == ["check", "exec", "check", "exec"]


def test_a_guest_reporting_the_hosts_kernel_is_refused(
    vm: QemuSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert vm.session is not None
    facts = vm.session.last_check
    monkeypatch.setattr(
        vm.session, "host", KernelFacts(str(facts["release"]), str(facts["boot_id"]))
    )
    with pytest.raises(GuestError, match="host's kernel"):
        vm.exec(["touch", "/workspace/should-not-exist"])
    monkeypatch.undo()
    assert vm.exec(["test", "-e", "/workspace/should-not-exist"]).exit_code == 1


def test_workspace_is_the_data_disk(vm: QemuSandbox, workspace: Path) -> None:
    res = vm.exec(["sh", "-c", "cat README; stat -c %u sub/data.bin; sha256sum sub/data.bin"])
    import hashlib

    digest = hashlib.sha256((workspace / "sub/data.bin").read_bytes()).hexdigest()
    assert res.stdout.decode().splitlines() == [
        "hello from the host",
        "64000",
        f"{digest}  sub/data.bin",
    ]
    res = vm.exec(["sh", "-c", "findmnt -no SOURCE,FSTYPE /workspace || mount | grep workspace"])
    assert b"ext4" in res.stdout


def test_root_and_agent_are_read_only(vm: QemuSandbox) -> None:
    res = vm.exec(
        ["sh", "-c", "touch /usr/x; echo $?; echo x > /opt/agentbox/vm/agent.py; echo $?"]
    )
    assert res.stdout.split() == [b"1", b"1"] or res.stdout.split() == [b"1", b"2"]
    assert vm.exec(["sh", "-c", "test -e /dev/kvm"]).exit_code == 1


def test_timeout_kills_the_command_not_the_sandbox(vm: QemuSandbox) -> None:
    t0 = time.monotonic()
    res = vm.exec(["sleep", "600"], timeout=2)
    assert res.timed_out and time.monotonic() - t0 < 60
    assert vm.exec(["echo", "alive"]).stdout == b"alive\n"


def test_copy_in_and_out_through_the_safe_path_layer(vm: QemuSandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d/f.txt").write_text("payload")
    vm.copy_in(src, "/workspace/incoming")
    assert vm.exec(["cat", "/workspace/incoming/d/f.txt"]).stdout == b"payload"
    # hostile shapes, made by the workload inside the guest
    hostile = (
        "cd /workspace/incoming && ln -s /etc/shadow evil && mkfifo pipe &&"
        " cp /bin/true suid && chmod 4755 suid && ln -s ../../../../ up && ln -s d/f.txt in"
    )
    vm.exec(["sh", "-c", hostile])
    out = tmp_path / "out"
    vm.copy_out("/workspace/incoming", out)
    assert (out / "d/f.txt").read_text() == "payload"
    assert not (out / "evil").is_symlink() and not (out / "up").exists()  # point out: dropped
    assert not (out / "pipe").exists()
    assert (out / "in").is_symlink() and (out / "in").read_text() == "payload"
    assert (out / "suid").stat().st_mode & 0o7777 == 0o755
    single = tmp_path / "single.txt"
    vm.copy_out("/workspace/incoming/d/f.txt", single)
    assert single.read_text() == "payload"


def test_gateway_streams_are_multiplexed_and_concurrent(vm: QemuSandbox) -> None:
    script = """
import socket, threading
out = {}
def one(i):
    s = socket.create_connection(("127.0.0.1", 8080), timeout=60)
    s.sendall(b"conn-%d\\n" % i)
    buf = b""
    while chunk := s.recv(100):
        buf += chunk
    out[i] = buf
ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
for i in sorted(out): print(out[i].decode().strip())
"""
    res = vm.exec(["python3", "-c", script], timeout=120)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.decode().splitlines() == [f"echo:conn-{i}" for i in range(8)]


def test_snapshot_clones_have_distinct_randomness(tracker: SandboxTracker, vm: QemuSandbox) -> None:
    assert vm.restored
    spec = SandboxSpec(name="qemu-clone", image="default", resources=RES)
    with tracker.create(spec) as other:
        a = vm.exec(["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"]).stdout
        b = other.exec(["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"]).stdout
        assert a and b and a != b
        assert other.exec(["ls", "-A", "/workspace"]).stdout in (b"", b"lost+found\n")


def test_a_restored_guest_has_the_agent_clis_start_pages_cached(tracker: SandboxTracker) -> None:
    """The template started the agent CLI once (``_preload``): the pages of its binary
    it read are in the snapshot's page cache, so the CLI's first start in a fresh restored
    guest reads next to nothing into it (without that preload: ~75 MiB of Claude Code's
    binary, into pages of the guest's own)."""
    spec = SandboxSpec(name="qemu-preload", image="default", resources=RES)
    with tracker.create(spec) as sb:
        assert isinstance(sb, QemuSandbox) and sb.restored
        if sb.exec(["sh", "-c", "command -v claude"]).exit_code != 0:
            pytest.skip("the default image has no claude")
        # mincore/fincore cannot tell: for a file the caller may not write, the kernel
        # reports every page resident. The page cache's growth can.
        out = sb.exec(["sh", "-c", "grep ^Cached: /proc/meminfo; claude --version >/dev/null; "
                                   "grep ^Cached: /proc/meminfo"])  # fmt: skip
        assert out.exit_code == 0, out
        before, after = (int(line.split()[1]) for line in out.stdout.decode().splitlines())
        assert after - before < 16 * 1024, out.stdout  # kB


def test_the_leak_guard_sees_a_live_vm(tracker: SandboxTracker) -> None:
    """The guard's positive control on qemu: while a microVM lives, the tracker finds its
    VMM (by recorded pid, and by name as for a detached VM whose pids it never saw), its
    cgroups (recorded, and by name) and its VM dir; once destroyed, nothing."""
    spec = SandboxSpec(name="qemu-guarded", image="default", resources=RES)
    box = tracker.create(spec)
    try:
        left = tracker.leftovers()
        by_name = SandboxTracker(tracker.backend, tracker.settings)
        by_name.track("qemu-guarded")  # no box: what is found is found by name alone
        try:
            named = by_name.leftovers()
        finally:
            by_name.close()
    finally:
        box.destroy()
    text, named_text = "\n".join(left), "\n".join(named)
    for what in ("still runs", "names it", "cgroup ", "VM dir "):
        assert what in text, (what, text)
    for what in ("names it", "cgroup ", "VM dir "):
        assert what in named_text, (what, named_text)
    assert tracker.leftovers() == []


@pytest.mark.slow
def test_cold_boot_and_one_shot_run_syncs_the_workspace(
    qemu_settings: Settings,
    qemu_rootfs: tuple[Path, str],
    tmp_path: Path,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep").write_text("k")
    (ws / "gone").write_text("g")
    backend = QemuBackend(qemu_settings, rootfs=qemu_rootfs, cold=True)
    spec = SandboxSpec(name="qemu-cold", image="default", resources=RES, workspace=ws)
    cold = sandbox_factory(backend, qemu_settings)
    res = cold.run(spec, ["sh", "-c", "rm gone; echo new > made; mkdir -p a/b; uname -r"])
    assert res.exit_code == 0 and res.stdout.startswith(b"6.1.")
    assert sorted(p.name for p in ws.iterdir()) == ["a", "keep", "made"]
    assert (ws / "made").read_text() == "new\n"
    assert not list((qemu_settings.data_dir / "microvm").glob("qemu-cold-*"))


def test_deadline_kills_the_vm(tracker: SandboxTracker) -> None:
    spec = SandboxSpec(name="qemu-deadline", image="default", resources=RES, deadline=20)
    t0 = time.monotonic()
    res = tracker.run(spec, ["sleep", "600"])
    assert res.timed_out and time.monotonic() - t0 < 120


def test_a_dead_guests_partial_data_is_still_collected(
    tracker: SandboxTracker, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "old").write_text("o")
    spec = SandboxSpec(name="qemu-dies", image="default", resources=RES, workspace=ws)
    with tracker.create(spec) as sb:
        script = (
            "rm old; echo partial > p; ln -s /etc/shadow out; ln -s p in; mkfifo f;"
            " cp /bin/true s; chmod 4755 s; sync"
        )
        assert sb.exec(["sh", "-c", script]).exit_code == 0
        os.kill(sb.vm.vmm_pid(), 9)
        with pytest.raises(GuestError):
            sb.exec(["true"], timeout=30)
        sb.sync_workspace()  # read off the dead guest's disk, in a jail, never mounted
    assert sorted(p.name for p in ws.iterdir()) == ["in", "p", "s"]
    assert (ws / "p").read_text() == "partial\n" and (ws / "in").is_symlink()
    assert (ws / "s").stat().st_mode & 0o7777 == 0o755


def test_kill_by_name_ends_a_run_and_keeps_its_data(
    qemu_backend: QemuBackend, tracker: SandboxTracker, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    spec = SandboxSpec(name="qemu-cancel", image="default", resources=RES, workspace=ws)
    written = threading.Event()
    got: list[ExecResult] = []

    def on_out(chunk: bytes) -> None:
        if b"go" in chunk:
            written.set()

    def run() -> None:
        script = "echo started > s; sync; echo go; sleep 600"
        got.append(tracker.run(spec, ["sh", "-c", script], on_stdout=on_out))

    t = threading.Thread(target=run)
    t.start()
    assert written.wait(120)
    assert qemu_backend.kill("qemu-cancel")  # what a launcher's cancel calls
    t.join(180)
    assert got, "run() did not return after the kill"
    assert got[0].exit_code == 137
    assert (ws / "s").read_text() == "started\n"  # collected off the dead guest's disk
    assert qemu_backend.kill("qemu-cancel") == []


def test_cleanup_orphans_ignores_live_owners(qemu_backend: QemuBackend) -> None:
    assert qemu_backend.cleanup_orphans() == []


# ------------------------------------------------------------------ a hostile workload / guest


def test_copy_in_never_lands_through_a_link_the_workload_planted(
    vm: QemuSandbox, tmp_path: Path
) -> None:
    # /run is root's tmpfs in the guest; the agent that extracts a copy_in runs as root.
    assert vm.exec(["sh", "-c", "ln -sfn /run /workspace/trap"]).exit_code == 0
    src = tmp_path / "planted"
    src.mkdir()
    (src / "f").write_text("x")
    with pytest.raises(GuestError, match="copy into"):
        vm.copy_in(src, "/workspace/trap/planted")
    assert vm.exec(["test", "-e", "/run/planted"]).exit_code == 1


@pytest.mark.parametrize("code", ["abc", 10**30])
def test_a_bad_exit_code_is_handled_like_a_crash(
    tracker: SandboxTracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: object
) -> None:
    # A guest agent that reports {"op": "exit", "code": <not an exit code>}: the
    # real guest's exit message is rewritten on its way in, as a compromised agent
    # would send it. The run must end like a crash, with the work collected.
    import agentbox.backends.microvm._channel as channel

    real = channel.decode_ctrl

    def hostile(payload: bytes) -> dict[str, object]:
        msg: dict[str, object] = real(payload)
        if msg["op"] == "exit":
            msg["code"] = code
        return msg

    monkeypatch.setattr(channel, "decode_ctrl", hostile)
    ws = tmp_path / "ws"
    ws.mkdir()
    spec = SandboxSpec(name="qemu-badexit", image="default", resources=RES, workspace=ws)
    res = tracker.run(spec, ["sh", "-c", "echo work > done; sync"])
    assert res.exit_code == 137
    assert b"protocol violation" in res.stderr
    assert (ws / "done").read_text() == "work\n"  # read off the killed guest's disk


_FLOOD = """
import json, os, socket, sys, threading, time
tok = os.environ["TOKEN"]
def request(tools):
    body = {"model": "test-model", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = [{"name": "t", "input_schema": {"type": "object"}}]
    data = json.dumps(body).encode()
    # keep-alive for the flood: uvicorn then holds what is pipelined behind it
    head = ("POST /v1/messages HTTP/1.1\\r\\nhost: gateway\\r\\nconnection: %s\\r\\n"
            "x-api-key: %s\\r\\n"
            "anthropic-version: 2023-06-01\\r\\ncontent-type: application/json\\r\\n"
            "content-length: %d\\r\\n\\r\\n" % ("keep-alive" if tools else "close", tok, len(data)))
    return head.encode() + data
pushed = [0]
def flood():
    s = socket.create_connection(("127.0.0.1", 8080))
    s.sendall(request(True))  # a streaming request to the slow model...
    s.settimeout(float(sys.argv[1]))
    block = b"z" * (1 << 20)
    try:  # ...and then up to 1 GiB more on the same connection
        for _ in range(1024):
            s.sendall(block)
            pushed[0] += len(block)
    except OSError as exc:
        print("flood ended:", exc, flush=True)
    print("pushed", pushed[0], flush=True)
t = threading.Thread(target=flood)
t.start()
time.sleep(2)
for i in range(3):  # the gateway still serves the task's other requests
    c = socket.create_connection(("127.0.0.1", 8080), timeout=120)
    c.sendall(request(False))
    answer = b""
    while chunk := c.recv(65536):
        answer += chunk
    print("answer", answer.split(b"\\r\\n", 1)[0].decode(), b"OK" in answer, flush=True)
    c.close()
t.join()
"""


@pytest.mark.slow
def test_a_gateway_flood_stays_in_the_guest(tracker: SandboxTracker, tmp_path: Path) -> None:
    import psutil

    from agentbox.guest.agent import GW_WINDOW
    from gateway_helpers import running_gateway

    script = {"name": "slow", "main": "tools", "side_reply": "OK",
              "turns": [{"text": "slow answer", "delay": 40}]}  # fmt: skip
    with running_gateway(tmp_path, script=script, unix=True) as gw:
        (tmp_path / "gateway.sock").symlink_to("gw.sock")
        spec = SandboxSpec(name="qemu-flood", image="default", resources=RES,
                           gateway_dir=tmp_path, env={"TOKEN": gw.token})  # fmt: skip
        with tracker.create(spec) as sb:
            assert sb.session is not None
            session = sb.session
            me = psutil.Process()
            before = me.memory_info().rss
            peak, held = [before], [0]
            stop = threading.Event()

            def watch() -> None:
                while not stop.wait(0.1):
                    peak[0] = max(peak[0], me.memory_info().rss)
                    held[0] = max(held[0], session.gateway_held)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                res = sb.exec(["python3", "-c", _FLOOD, "25"], timeout=300)
            finally:
                stop.set()
                watcher.join()
            out = res.stdout.decode().splitlines()
            print(out, f"host held at most {held[0]} B, RSS +{peak[0] - before} B")
            assert res.exit_code == 0, res.stderr
            assert [ln for ln in out if ln.startswith("answer")] == [
                "answer HTTP/1.1 200 OK True"
            ] * 3
            assert held[0] <= GW_WINDOW
            assert peak[0] - before < 64 * 1024 * 1024
            assert sb.alive()
