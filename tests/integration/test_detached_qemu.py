"""Detached microVMs (issue 19 item 6): real QEMU (TCG here), the real default image.

* a "launcher" (a child process) launches a VM and is SIGKILLed; the VM runs on
  (its monitor is no child of the launcher, in no process group of it), its
  agent reaches the gateway after the kill, and a fresh backend object in
  *this* process re-adopts it and follows it to its end: the whole output in
  order, stdout and stderr apart, the exit code, the workspace written back,
  and nothing left (monitor, VMM, cgroups, VM dir, socket, record);
* its deadline holds with nobody following: the VM dies, a follower that comes
  later reports ``timed_out``; meanwhile a record from another data dir, a
  tampered record and a reused pid are refused.

Each detached sandbox is also registered with the leak guard
(:class:`~sandbox_leaks.SandboxTracker`, by name): after the test no process, cgroup,
VM dir or socket naming it may remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends import Exited
from agentbox.backends._k8slog import read_exit
from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend
from agentbox.backends.microvm.qemu import _records as records
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.errors import SandboxGone
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.skipif(os.geteuid() != 0, reason="VM cgroups and jails need root"),
]

RES = Resources(memory="512MiB", cpus=1)
#: The hierarchies systemd kills a unit by, as mounted on a hybrid host.
UNIT_HIERARCHIES = [h for h in ("systemd", "unified") if Path(f"/sys/fs/cgroup/{h}").is_dir()]


def _backend(settings: Settings, rootfs: tuple[Path, str]) -> QemuBackend:
    return QemuBackend(settings, rootfs=rootfs)


@pytest.fixture(scope="module")
def rootfs() -> tuple[Path, str]:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    return info.rootfs, info.hash


#: The gateway answers only once this is set: the request spans the launcher's death.
RELEASE = threading.Event()


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(4096)
        RELEASE.wait(300)
        self.wfile.write(b"echo:" + line)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    yield Settings(data_dir=data)


@pytest.fixture
def gateway_dir(settings: Settings) -> Iterator[Path]:
    d = settings.data_dir / "gw"
    d.mkdir()
    srv = _Server(str(d / "gateway.sock"), _Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield d
    srv.shutdown()
    srv.server_close()


def _workspace(settings: Settings) -> Path:
    ws = settings.data_dir / "tasks" / "t1" / "workspace"
    ws.mkdir(parents=True)
    (ws / "README").write_text("hello from the host\n")
    os.chown(ws, 64000, 64000)
    os.chown(ws / "README", 64000, 64000)
    return ws


def _follow(backend: QemuBackend, name: str, log: Path) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    ended = backend.follow(name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.05)
    return ended, b"".join(out), b"".join(err)


def _vmm_pids(settings: Settings) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["name", "cmdline"])
        if (p.info["name"] or "").startswith("qemu-system")
        and str(settings.data_dir) in " ".join(p.info["cmdline"] or [])
    ]


def _leftovers(settings: Settings, name: str, monitor: records.Identity) -> list[str]:
    left = [f"VMM {pid}" for pid in _vmm_pids(settings)]
    if monitor.process() is not None:
        left.append(f"monitor {monitor.pid}")
    vms = settings.data_dir / "microvm"
    if vms.is_dir():
        left += [f"VM dir {d.name}" for d in vms.iterdir()]
    for root in (Path("/sys/fs/cgroup/pids/agentbox"), Path("/sys/fs/cgroup/memory/agentbox")):
        if root.is_dir():
            left += [f"cgroup {d}" for d in root.iterdir() if d.name.startswith(name)]
    recs = settings.data_dir / records.RECORD_DIR
    if recs.is_dir():
        left += [f"record {f.name}" for f in recs.iterdir()]
    return left


_LAUNCHER = """
import pickle, sys, time
from agentbox.backends.microvm.qemu import QemuBackend
settings, rootfs, spec, argv, log, units = pickle.loads(sys.stdin.buffer.read())
for procs in units:  # the launcher runs in a (emulated) systemd unit's cgroup
    with open(procs, "w") as fh:
        fh.write("0")
be = QemuBackend(settings, rootfs=rootfs)
be.launch(spec, argv, log=log)
print("launched", flush=True)
time.sleep(3600)
"""

_SCRIPT = r"""
echo start; cat /workspace/README; echo to-stderr >&2
python3 -c '
import socket
s = socket.create_connection(("127.0.0.1", 8080)); s.sendall(b"after the kill\n")
print(s.makefile().readline().strip())'
printf 'x%.0s' $(seq 1 20000) | head -c 20000; echo
printf '2026-01-01T00:00:00Z stderr F forged\n\377\376\n'
echo written > /workspace/out.txt; echo end; exit 7
"""


@pytest.fixture
def unit_cgroups() -> Iterator[list[Path]]:
    """A systemd service's cgroup, emulated, in the hierarchies systemd kills a unit by."""
    name = f"agentbox-test-qemu-{os.getpid()}.service"
    dirs = [Path("/sys/fs/cgroup", h, name) for h in UNIT_HIERARCHIES]
    for d in dirs:
        d.mkdir()
    yield dirs
    for d in dirs:
        with contextlib.suppress(OSError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):
            with contextlib.suppress(OSError):
                d.rmdir()
                break
            time.sleep(0.1)


def _kill_unit(dirs: list[Path]) -> None:
    """``systemctl restart`` of the unit: every process in its cgroups is SIGKILLed."""
    for d in dirs:
        for pid in (d / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


Factory = Callable[[QemuBackend, Settings], SandboxTracker]


def test_a_killed_launcher_leaves_the_vm_to_a_new_one(
    settings: Settings,
    gateway_dir: Path,
    rootfs: tuple[Path, str],
    unit_cgroups: list[Path],
    sandbox_factory: Factory,
) -> None:
    import pickle

    ws = _workspace(settings)
    log = settings.data_dir / "tasks" / "t1" / "sandbox.log"
    name = "agentbox-t1"
    sandbox_factory(_backend(settings, rootfs), settings).track(name)  # launched by the child
    labels = {"io.agentbox.task": "t1"}
    spec = SandboxSpec(
        name=name, image="default", resources=RES, workspace=ws, gateway_dir=gateway_dir,
        labels=labels, deadline=600,
    )  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        units = [d / "cgroup.procs" for d in unit_cgroups]
        argv = ["sh", "-c", _SCRIPT]
        child.stdin.write(pickle.dumps((settings, rootfs, spec, argv, log, units)))
        child.stdin.close()
        assert child.stdout.readline() == b"launched\n", "the launcher did not launch"
        launcher = psutil.Process(child.pid)
        rec = records.read_record(settings, name)
        assert rec is not None and rec["vm"] is not None
        for d in unit_cgroups:  # neither the monitor nor QEMU is in the unit's cgroups
            procs = (d / "cgroup.procs").read_text().split()
            assert str(rec["monitor"][0]) not in procs and str(rec["vm"][1]) not in procs, d
        _kill_unit(unit_cgroups)  # a unit restart, and the launcher's whole process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        monitor = records.Identity(*rec["monitor"])
        assert monitor.process() is not None
        assert psutil.Process(monitor.pid).ppid() != launcher.pid
        assert os.getpgid(monitor.pid) != child.pid and os.getsid(monitor.pid) == monitor.pid
        vmm = psutil.Process(rec["vm"][1])
        assert vmm.is_running() and vmm.name().startswith("qemu-system")
        assert os.getsid(vmm.pid) != child.pid
        # The token the guest agent holds never reached the disk: the record has none.
        assert "token" not in json.dumps(rec).lower()
        assert oct(records.record_path(settings, name).stat().st_mode & 0o777) == "0o600"

        fresh = _backend(settings, rootfs)
        assert fresh.adoptable(name, labels=labels)
        assert not fresh.adoptable(name, labels={"io.agentbox.task": "t2"})
        # The agent's request to the gateway, made before the kill, is answered only now:
        # with no launcher, the monitor carries the stream.
        RELEASE.set()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    ended, out, err = _follow(fresh, name, log)
    assert ended == Exited(7, False), (out[-2000:], err[-2000:])
    lines = out.split(b"\n")
    assert lines[:3] == [b"start", b"hello from the host", b"echo:after the kill"], out[:500]
    assert lines[3] == b"x" * 20000
    # Hostile bytes come back as they were: a forged record prefix stays stdout.
    assert lines[4:] == [b"2026-01-01T00:00:00Z stderr F forged", b"\xff\xfe", b"end", b""]
    assert err == b"to-stderr\n"
    assert (ws / "out.txt").read_text() == "written\n"
    assert _leftovers(settings, name, monitor) == []
    # Followed to its end: a second follow finds nothing to adopt (the end was recorded).
    assert not fresh.adoptable(name, labels=labels)


def test_the_deadline_holds_without_a_launcher_and_forgeries_are_refused(
    settings: Settings, rootfs: tuple[Path, str], tmp_path: Path, sandbox_factory: Factory
) -> None:
    backend = _backend(settings, rootfs)
    name = "agentbox-t2"
    log = settings.data_dir / "t2.log"
    spec = SandboxSpec(name=name, image="default", resources=RES, deadline=8)
    tracker = sandbox_factory(backend, settings)
    tracker.launch(spec, ["sh", "-c", "echo up; sleep 600; echo never"], log=log)
    try:
        rec = records.read_record(settings, name)
        assert rec is not None
        path = records.record_path(settings, name)
        good = path.read_bytes()
        # Another data dir's launcher: the record copied there is not sealed for it.
        other = Settings(data_dir=tmp_path / "other")
        (other.data_dir / records.RECORD_DIR).mkdir(parents=True)
        shutil.copy(path, other.data_dir / records.RECORD_DIR / path.name)
        other_backend = _backend(other, rootfs)
        assert not other_backend.adoptable(name, labels={})
        with pytest.raises(SandboxGone):
            other_backend.follow(name, log=log, on_stdout=None, on_stderr=None)
        # A tampered record (the monitor pid pointed at another process): seal broken.
        forged = json.loads(good)
        forged["monitor"] = [os.getpid(), psutil.Process().create_time()]
        path.write_text(json.dumps(forged))
        assert not backend.adoptable(name, labels={})
        # A record sealed by this data dir naming a pid now another process's (reused).
        records.write_record(
            settings, spec, log=log, monitor=records.Identity(os.getpid(), 1.0), vm=None
        )
        assert not backend.adoptable(name, labels={})
        path.write_bytes(good)
        assert backend.adoptable(name, labels={})
        # Nobody follows: the monitor's own timer kills the VM at the deadline.
        psutil.Process(rec["vm"][1]).wait(300)
        monitor = records.Identity(*rec["monitor"])
        for _ in range(600):
            if monitor.process() is None:
                break
            time.sleep(0.2)
        assert monitor.process() is None, "the monitor did not end after the deadline"
        assert read_exit(log) == Exited(137, True)
    finally:
        backend.kill(name)
    ended, out, _ = _follow(backend, name, log)
    assert ended.timed_out and ended.exit_code == 137, ended
    assert out == b"up\n"
    assert _leftovers(settings, name, monitor) == []
    assert not _vmm_pids(settings)


def test_reap_ends_a_detached_vm_and_saves_what_it_wrote(
    settings: Settings, rootfs: tuple[Path, str], sandbox_factory: Factory
) -> None:
    """An orphan sweep (its task gone) reaps a VM whose monitor lives: the VM is killed,
    the monitor writes /data back into the workspace and ends; nothing is left."""
    backend = _backend(settings, rootfs)
    ws = _workspace(settings)
    name = "agentbox-t3"
    log = settings.data_dir / "t3.log"
    spec = SandboxSpec(name=name, image="default", resources=RES, workspace=ws, deadline=600)
    script = "echo kept > /workspace/kept.txt; sync; echo up; sleep 600"
    tracker = sandbox_factory(backend, settings)
    with tracker.create(spec.replace(name="agentbox-t3-warm")):
        pass  # the snapshot exists: the launcher holds its RAM's memfd
    ref = backend.ram_ref(spec)
    assert ref is not None
    tracker.launch(spec, ["sh", "-c", script], log=log)
    rec = records.read_record(settings, name)
    assert rec is not None and rec["vm"] is not None
    monitor = records.Identity(*rec["monitor"])
    try:
        # The monitor's VM maps the launcher's memfd: one copy per launcher, not per VM.
        maps = Path(f"/proc/{rec['vm'][1]}/maps").read_text().splitlines()
        inodes = {int(line.split()[4]) for line in maps if "agentbox-snapshot-ram" in line}
        assert inodes == {os.fstat(int(str(ref["fd"]))).st_ino}
        for _ in range(600):  # until the guest wrote its file (its output says so)
            if b"up" in log.read_bytes():
                break
            time.sleep(0.2)
        assert name in backend.reap(name)
        assert monitor.process() is None
        assert (ws / "kept.txt").read_text() == "kept\n"
    finally:
        backend.kill(name)
    assert _leftovers(settings, name, monitor) == []
