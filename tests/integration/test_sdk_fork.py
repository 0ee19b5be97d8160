"""``Sandbox.fork(n)`` on podman, docker and qemu (podman also in tests/integration/test_sdk.py,
as a member of the group agentbox): a file written before the fork is in every fork, a write in one
fork is in neither another nor the parent; each fork is a sandbox of the same backend with
its own deadline, removed with its ``with``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.sdk import Sandbox
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root")


@pytest.fixture
def launcher_sock() -> Iterator[tuple[Path, Path]]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-sdk-fork-", dir="/var/tmp"))
    base.chmod(0o711)
    env = {"PATH": os.environ["PATH"], "HOME": str(base), "AGENTBOX_DATA_DIR": str(base / "data"),
           "AGENTBOX_LOG_LEVEL": "info"}  # fmt: skip
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    log = base / "launcher.log"
    with log.open("wb") as err:
        serve = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        sock = base / "data" / "launcher.sock"
        for _ in range(600):
            if sock.exists():
                break
            assert serve.poll() is None, "the launcher exited"
            time.sleep(0.1)
        yield sock, log
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(base, ignore_errors=True)


BACKENDS = [
    pytest.param("podman", marks=pytest.mark.podman),
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("qemu", marks=pytest.mark.qemu),
]


def _a_write_stays_in_its_fork(parent: Any, f1: Any, f2: Any) -> None:
    """A write in fork ``f1`` (a changed file, a new one) is in neither ``f2`` nor the parent."""
    r = f1.commands.run("echo one >> /workspace/before.txt && echo 1 > /workspace/only1")
    assert r.exit_code == 0, r
    assert f1.files.read("/workspace/before.txt") == "parent\none\n"
    assert f2.files.read("/workspace/before.txt") == "parent\n"
    assert parent.files.read("/workspace/before.txt") == "parent\n"
    assert f2.commands.run("test -e /workspace/only1").exit_code == 1
    assert parent.commands.run("test -e /workspace/only1").exit_code == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_copies_the_files_and_keeps_the_copies_apart(
    launcher_sock: tuple[Path, Path], backend: str
) -> None:
    sock, log = launcher_sock
    with Sandbox.create(backend=backend, timeout=600, address=sock) as sb:
        sb.files.write("/workspace/before.txt", "parent\n")
        sb.files.write("/tmp/t.txt", "tmpfs\n")
        forks = sb.fork(2, timeout=300)
        try:
            assert len({sb.id, *(f.id for f in forks)}) == 3
            assert all(f.info.backend == backend for f in forks)
            assert all(290 <= f.info.deadline_at - time.time() <= 300 for f in forks)
            for f in forks:
                assert f.files.read("/workspace/before.txt") == "parent\n"
                assert f.files.read("/tmp/t.txt") == "tmpfs\n"
            f1, f2 = forks
            _a_write_stays_in_its_fork(sb, f1, f2)
        finally:
            for f in forks:
                f.close()
        live = {i.id for i in Sandbox.list(address=sock)}
        assert not live & {f.id for f in forks} and sb.id in live
    said = log.read_text(errors="replace")
    print("\n".join(ln for ln in said.splitlines() if "fork" in ln))
    if backend in ("podman", "docker"):  # the frozen parent copied on the host, not inside
        assert "sdk sandbox forked" in said and "copying inside instead" not in said
        # each fork's workspace an overlay of one frozen copy, unmounted with the fork
        assert said.count("fork workspace: an overlay of the parent's") == 2
        assert not _mounts_under(log.parent)


def _mounts_under(base: Path) -> list[str]:
    points = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p.startswith(str(base.resolve()))]


def test_fork_layers_left_by_a_dead_launcher_are_settled(tmp_path: Path) -> None:
    """A fork's overlay and its layer's loop mount, left by a launcher that died (its
    stack never closed), are unmounted and deleted by the next launcher's keeper."""
    import contextlib

    from agentbox.boxfile import DiskLimit
    from agentbox.launcher._fork import Lower, overlay_workspace, settle_fork_layers

    scratch = tmp_path / "scratch"
    (scratch / "lower").mkdir(parents=True)
    (scratch / "lower" / "f").write_text("x")
    ws = scratch / "sdk-1"
    ws.mkdir()
    stack = contextlib.ExitStack()  # never closed: the launcher "died"
    merged = overlay_workspace(Lower(scratch / "lower"), ws, uid=12345, stack=stack,
                               limit=DiskLimit(size=64 * 1024**2, inodes=4096))  # fmt: skip
    try:
        assert (merged / "f").read_text() == "x" and (merged / "f").stat().st_uid == 12345
        assert (scratch / "lower" / "f").stat().st_uid == 0  # the lower is never written
        assert len(_mounts_under(scratch)) == 2
        assert settle_fork_layers(scratch) == ["sdk-1.fork"]
        assert not _mounts_under(scratch) and not (scratch / "sdk-1.fork").exists()
    finally:
        stack.close()


# -- qemu: a fork from a snapshot of the live VM (memory, processes, tmpfs, disk) ----------

#: A process holding a value only in its memory: it writes it out when it gets SIGUSR1.
_HOLDER = (
    "import os, secrets, signal, time\n"
    "v = secrets.token_hex(8)\n"
    "def dump(*_):\n"
    "    with open('/workspace/held-%d' % os.getpid(), 'w') as f: f.write(v)\n"
    "signal.signal(signal.SIGUSR1, dump)\n"
    "open('/tmp/holder.pid', 'w').write(str(os.getpid()))\n"
    "while True: time.sleep(1)\n"
)


@pytest.mark.qemu
def test_qemu_fork_carries_memory_and_processes(launcher_sock: tuple[Path, Path]) -> None:
    sock, log = launcher_sock
    with Sandbox.create(backend="qemu", timeout=600, address=sock) as sb:
        sb.files.write("/workspace/before.txt", "parent\n")
        sb.files.write("/tmp/holder.py", _HOLDER)
        r = sb.commands.run("setsid -f python3 /tmp/holder.py </dev/null >/dev/null 2>&1; "
                            "for i in $(seq 100); do [ -s /tmp/holder.pid ] && break; sleep 0.2; "
                            "done; cat /tmp/holder.pid")  # fmt: skip
        assert r.exit_code == 0 and r.stdout.strip().isdigit(), r
        pid = r.stdout.strip()
        # A command of the parent's session still running (and printing) at the fork: in a
        # fork its output has no reader, and must not break the fork's channel.
        ticker = sb.commands.run("while :; do echo tick; sleep 0.5; done", background=True)
        forks = sb.fork(2, timeout=300)
        try:
            assert all(f.info.backend == "qemu" for f in forks)
            f1, f2 = forks
            for f in forks:
                assert f.files.read("/workspace/before.txt") == "parent\n"
                # the process and its memory: the value it holds is written on a signal
                r = f.commands.run(f"kill -USR1 {pid} && for i in $(seq 100); do "
                                   f"[ -s /workspace/held-{pid} ] && break; sleep 0.2; done; "
                                   f"cat /workspace/held-{pid}")  # fmt: skip
                assert r.exit_code == 0 and len(r.stdout.strip()) == 16, r
            v1 = f1.files.read(f"/workspace/held-{pid}")
            assert f2.files.read(f"/workspace/held-{pid}") == v1
            assert sb.commands.run(f"kill -USR1 {pid} && sleep 2 && cat /workspace/held-{pid}"
                                   ).stdout.strip() == v1  # fmt: skip
            # the disk: copy-on-write per fork
            _a_write_stays_in_its_fork(sb, f1, f2)
            # tmpfs (RAM) is the parent's too, then each its own
            f2.files.write("/tmp/only2", "2")
            assert f1.commands.run("test -e /tmp/only2").exit_code == 1
            assert f1.files.read("/tmp/holder.py") == _HOLDER
            # the kernel RNG was reseeded in each fork: their first bytes differ
            rnd = "head -c 16 /dev/urandom | od -An -tx1"
            outs = {f.commands.run(rnd).stdout for f in (*forks, sb)}
            assert len(outs) == 3
            # the ticker prints on in each fork, to nobody; the forks' channels stand
            for f in forks:
                assert f.commands.run("sleep 2; echo ok").stdout == "ok\n"
        finally:
            for f in forks:
                f.close()
        assert sb.commands.run("true").exit_code == 0  # the parent works on
        ticker.kill()
    said = log.read_text(errors="replace")
    assert "fork: parent saved" in said and "vm frozen for forks" in said


@pytest.mark.qemu
def test_qemu_forks_rekeyed_and_their_disks_collectable(
    sandbox_factory: Callable[[Any, Settings], SandboxTracker], tmp_path: Path
) -> None:
    """The backend's half: each fork's agent holds its own session token; a fork's
    copy-on-write disk (a qcow2 overlay over the frozen base) is read back from a dead
    fork as any /data disk is."""
    from agentbox.backends.base import SandboxSpec
    from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
    from agentbox.boxfile import Resources
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path / "data")
    be = QemuBackend(settings, rootfs=(info.rootfs, info.hash))
    tracker = sandbox_factory(be, settings)
    res = Resources(memory="1GiB", cpus=1)
    parent = tracker.create(SandboxSpec(name="fork-parent", image="default", resources=res))
    assert isinstance(parent, QemuSandbox)
    assert parent.exec(["sh", "-c", "echo base > /workspace/a"]).exit_code == 0
    into = settings.data_dir / "microvm" / ".fork-test"
    into.mkdir()
    assert parent.vm.cfg.ram_fd is not None  # restored: its RAM the template's memfd
    template = os.fstat(parent.vm.cfg.ram_fd).st_blocks * 512
    frozen = be.freeze(parent, into)
    # QEMU never read the parent's RAM: the template's shared memfd gained no page for
    # each one the parent never touched (a migration would add up to its 1 GiB)
    assert os.fstat(parent.vm.cfg.ram_fd).st_blocks * 512 - template < 64 * 1024**2
    forks = []
    for i in range(2):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        spec = SandboxSpec(name=f"fork-child{i}", image="default", resources=res, workspace=ws)
        tracker.track(spec.name)
        child = be.fork(spec, frozen)
        tracker.track(spec.name, child)
        forks.append(child)
    assert frozen.ram_fd is not None  # a restored parent: its RAM shared by the forks
    frozen.close()
    shutil.rmtree(into)  # the forks keep their own links to the base
    tokens = {b.session.token for b in (parent, *forks) if b.session is not None}
    assert len(tokens) == 3
    f0, f1 = forks
    assert f0.exec(["sh", "-c", "echo zero >> /workspace/a; sync"]).exit_code == 0
    assert f1.exec(["cat", "/workspace/a"]).stdout == b"base\n"
    # a fork forked again: its overlay and base flattened into the grandchild's base
    assert f1.exec(["sh", "-c", "echo f1 > /workspace/b; sync"]).exit_code == 0
    into2 = settings.data_dir / "microvm" / ".fork-test2"
    into2.mkdir()
    again = be.freeze(f1, into2)
    flat = subprocess.run(["debugfs", "-R", "cat /b", str(again.base)], capture_output=True)
    assert flat.stdout == b"f1\n", flat.stderr[-300:]
    spec = SandboxSpec(name="fork-grandchild", image="default", resources=res)
    tracker.track(spec.name)
    grand = be.fork(spec, again)
    tracker.track(spec.name, grand)
    again.close()
    shutil.rmtree(into2)
    assert f1.exec(["sh", "-c", "echo one >> /workspace/a"]).exit_code == 0
    assert grand.exec(["cat", "/workspace/a"]).stdout == b"base\n"
    grand.destroy()
    f0.vm.terminate()  # dead: its disk is read in a jail (qcow2 flattened first)
    f0.sync_workspace()
    assert (tmp_path / "ws0" / "a").read_text() == "base\nzero\n"
    for b in (*forks, parent):
        b.destroy()


@pytest.mark.qemu
def test_qemu_fork_of_a_vm_with_a_declared_mount(
    sandbox_factory: Callable[[Any, Settings], SandboxTracker], tmp_path: Path
) -> None:
    """A fork has its parent's device set: its declared (read-only) mount is a disk of
    its own, copied from the parent's, and mounted where the parent had it."""
    from agentbox.backends.base import BindMount, SandboxSpec
    from agentbox.backends.microvm.qemu import QemuBackend
    from agentbox.boxfile import Resources
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path / "data")
    be = QemuBackend(settings, rootfs=(info.rootfs, info.hash))
    tracker = sandbox_factory(be, settings)
    src = tmp_path / "deps"
    src.mkdir()
    (src / "lib.txt").write_text("dep\n")
    res = Resources(memory="1GiB", cpus=1)
    mounts = (BindMount(src, "/tmp/deps"),)
    spec = SandboxSpec(name="fork-m-parent", image="default", resources=res, mounts=mounts)
    parent = tracker.create(spec)
    into = settings.data_dir / "microvm" / ".fork-m"
    into.mkdir()
    frozen = be.freeze(parent, into)
    child_spec = SandboxSpec(name="fork-m-child", image="default", resources=res, mounts=mounts)
    tracker.track(child_spec.name)
    child = be.fork(child_spec, frozen)
    tracker.track(child_spec.name, child)
    frozen.close()
    shutil.rmtree(into)
    parent.destroy()  # the fork's mount disk is its own
    assert child.exec(["cat", "/tmp/deps/lib.txt"]).stdout == b"dep\n"
    assert child.exec(["sh", "-c", "echo x > /tmp/deps/new"]).exit_code != 0  # read-only
    child.destroy()


@pytest.mark.qemu
def test_qemu_fork_of_a_cold_booted_vm(
    sandbox_factory: Callable[[Any, Settings], SandboxTracker], tmp_path: Path
) -> None:
    """A VM booted cold (anonymous RAM, no snapshot) is migrated whole; its fork loads
    the RAM from the stream and has its parent's tmpfs and disk."""
    from agentbox.backends.base import SandboxSpec
    from agentbox.backends.microvm.qemu import QemuBackend
    from agentbox.boxfile import Resources
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path / "data")
    be = QemuBackend(settings, cold=True, rootfs=(info.rootfs, info.hash))
    tracker = sandbox_factory(be, settings)
    res = Resources(memory="512MiB", cpus=1)
    parent = tracker.create(SandboxSpec(name="fork-cold", image="default", resources=res))
    assert parent.exec(["sh", "-c", "echo t > /tmp/t; echo w > /workspace/w"]).exit_code == 0
    into = settings.data_dir / "microvm" / ".fork-cold"
    into.mkdir()
    frozen = be.freeze(parent, into)
    assert frozen.ram_fd is None  # the RAM is in the stream
    spec = SandboxSpec(name="fork-cold-child", image="default", resources=res)
    tracker.track(spec.name)
    child = be.fork(spec, frozen)
    tracker.track(spec.name, child)
    shutil.rmtree(into)
    assert child.exec(["cat", "/tmp/t", "/workspace/w"]).stdout == b"t\nw\n"
    assert parent.exec(["true"]).exit_code == 0
    child.destroy()
    parent.destroy()
