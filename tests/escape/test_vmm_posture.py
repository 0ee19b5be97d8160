"""The VMM's confinement, read off the running QEMU process; a fork bomb; a killed host.

Everything is read from ``/proc`` of the live VMM (every thread), never from
the configuration that was meant to produce it. Every sandbox is made through a
:class:`~sandbox_leaks.SandboxTracker`: nothing of it may survive its end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox, vmm_uid
from agentbox.backends.microvm.qemu._posture import thread_status
from agentbox.boxfile import Resources
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

RES = Resources(memory="1GiB", cpus=1)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> QemuBackend:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path_factory.mktemp("escape-qemu"))
    return QemuBackend(settings, rootfs=(info.rootfs, info.hash))


@pytest.fixture(scope="module", params=["standard", "strict"])
def sandbox(
    request: pytest.FixtureRequest,
    backend: QemuBackend,
    module_sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> Iterator[QemuSandbox]:
    spec = SandboxSpec(name=f"posture-{request.param}", image="default", resources=RES,
                       isolation=request.param)  # fmt: skip
    sb = module_sandbox_factory(backend, backend.settings).create(spec)
    assert isinstance(sb, QemuSandbox)
    yield sb
    sb.destroy()


@pytest.fixture
def tracker(
    backend: QemuBackend, sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker]
) -> SandboxTracker:
    """The test's own sandboxes, checked for leftovers after it."""
    return sandbox_factory(backend, backend.settings)


def test_every_vmm_thread_is_confined(sandbox: QemuSandbox) -> None:
    pid = sandbox.vm.vmm_pid()
    assert Path(f"/proc/{pid}/exe").resolve().name.startswith("qemu-system")
    threads = thread_status(pid)
    assert len(threads) >= 2  # vCPU + main loop at least: the check covers them all
    for t in threads:
        assert t.cap_eff == 0, t
        assert t.no_new_privs == 1, t
        assert t.seccomp == 2, t
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    flags = cmdline[cmdline.index(b"-sandbox") + 1].decode()
    for deny in ("obsolete=deny", "elevateprivileges=deny", "spawn=deny", "resourcecontrol=deny"):
        assert deny in flags
    assert not any(b"guestfwd" in a or a == b"-netdev" for a in cmdline)


def test_vmm_uid_matches_isolation(sandbox: QemuSandbox, backend: QemuBackend) -> None:
    pid = sandbox.vm.vmm_pid()
    uids = {u for t in thread_status(pid) for u in t.uids}
    want = vmm_uid(backend.settings, sandbox.spec.isolation)
    assert uids == {want}
    if sandbox.spec.isolation == "strict":
        assert os.getuid() not in uids
        # the strict uid owns nothing outside the VM's own directory
        assert want not in {os.stat(p).st_uid for p in (Path.home(), Path("/etc"), Path("/tmp"))}


def test_vmm_namespaces_are_its_own(sandbox: QemuSandbox) -> None:
    pid = sandbox.vm.vmm_pid()
    for ns in ("mnt", "pid", "ipc", "uts", "net"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    # its network namespace holds nothing but a (down) loopback
    assert Path(f"/proc/{pid}/net/dev").read_text().count(":") == 1


def test_vmm_jail_holds_only_declared_files(sandbox: QemuSandbox) -> None:
    pid = sandbox.vm.vmm_pid()
    root = Path(f"/proc/{pid}/root")
    assert sorted(p.name for p in (root / "vm").iterdir()) == [
        "data.img", "initramfs", "root.img", "run", "vmlinux",
    ]  # fmt: skip
    top = {p.name for p in root.iterdir()}
    assert top <= {"usr", "lib", "lib64", "bin", "sbin", "dev", "proc", "tmp", "vm"}
    assert not (root / "dev/kvm").exists()
    assert not (root / "home").exists() and not (root / "etc").exists()


def test_vmm_cgroup_limits(sandbox: QemuSandbox) -> None:
    pid = sandbox.vm.vmm_pid()
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    seen = {}
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            seen[c] = path
    pids = Path("/sys/fs/cgroup/pids") / seen["pids"].lstrip("/") / "pids.max"
    mem = Path("/sys/fs/cgroup/memory") / seen["memory"].lstrip("/") / "memory.limit_in_bytes"
    assert seen["pids"].startswith("/agentbox/") and pids.read_text().strip().isdigit()
    assert int(mem.read_text()) <= (RES.memory + 1024**3)


def test_posture_report_is_all_ok(sandbox: QemuSandbox) -> None:
    posture = sandbox.posture()
    assert posture.ok, [c for c in posture.checks if not c.ok]


def test_fork_bomb_leaves_the_host_responsive(tracker: SandboxTracker) -> None:
    spec = SandboxSpec(name="forkbomb", image="default", resources=RES)
    with tracker.create(spec) as sb:
        lat: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                subprocess.run(["true"], check=True)
                lat.append(time.monotonic() - t0)
                time.sleep(0.1)

        t = threading.Thread(target=probe)
        t.start()
        try:
            sb.exec(["sh", "-c", "b(){ b|b& }; b"], timeout=20)
        finally:
            stop.set()
            t.join()
        vmm = psutil.Process(sb.vm.vmm_pid())
        assert vmm.num_threads() <= 128
        # a check, not a benchmark: the host kept answering within a generous bound
        assert lat and max(lat) < 3.0, max(lat)


def test_killing_the_host_process_leaves_no_qemu(
    backend: QemuBackend,
    tmp_path: Path,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    rootfs, key = backend._rootfs or (None, None)
    # Made by the child below: the guard looks for it by name (its VMM, cgroups, VM dir).
    orphan_settings = Settings(data_dir=tmp_path)
    sandbox_factory(QemuBackend(orphan_settings), orphan_settings).track("orphan")
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from agentbox.backends.microvm.qemu import QemuBackend
        from agentbox.backends.base import SandboxSpec
        from agentbox.boxfile import Resources
        from agentbox.config import Settings
        b = QemuBackend(Settings(data_dir=Path({str(tmp_path)!r})),
                        rootfs=(Path({str(rootfs)!r}), {key!r}))
        sb = b.create(SandboxSpec(name="orphan", image="default",
                                  resources=Resources(memory="1GiB", cpus=1)))
        print(sb.vm.vmm_pid(), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), line
        qpid = int(line)
        assert psutil.pid_exists(qpid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    end = time.monotonic() + 15
    while psutil.pid_exists(qpid) and time.monotonic() < end:
        try:
            if psutil.Process(qpid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    alive = psutil.pid_exists(qpid) and psutil.Process(qpid).status() != psutil.STATUS_ZOMBIE
    assert not alive, "QEMU survived its host process"
    # a later backend instance reclaims what the dead process left
    leftover = QemuBackend(Settings(data_dir=tmp_path)).cleanup_orphans()
    assert len(leftover) == 1 and leftover[0].startswith("orphan-")


def test_output_flood_is_bounded_and_times_out(sandbox: QemuSandbox) -> None:
    if sandbox.spec.isolation == "strict":
        pytest.skip("one flood is enough")
    t0 = time.monotonic()
    res = sandbox.exec(["sh", "-c", "cat /dev/zero"], timeout=8)
    assert res.timed_out and time.monotonic() - t0 < 60
    assert 0 < len(res.stdout) <= 64 * 1024**2
    assert sandbox.exec(["echo", "still here"]).stdout == b"still here\n"
