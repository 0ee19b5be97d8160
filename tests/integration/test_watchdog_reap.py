"""The watchdog acts on every backend by name, and the moment a sandbox's owner dies.

No VMM is needed: a microVM sandbox is, to the host, a VM dir under
``data_dir/microvm`` whose owner file names it, and a cgroup holding its VMM.
Here a ``sleep`` stands in for the VMM, in the very cgroup dirs Firecracker's
jailer makes (:func:`agentbox.backends.microvm._firecracker.cgroup_dirs`). The watchdog
is the real one, spawned as the launcher and the CLI spawn it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import LABEL
from agentbox.launcher._watchdog import kill_sandbox, process_start, spawn_watchdog

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups of VMMs need root")

MICROVM_BACKENDS = ["qemu", "firecracker"]


class FakeVm:
    """A VM dir with an owner file, and a stand-in VMM in the VM's cgroup."""

    def __init__(self, data_dir: Path, sandbox: str, owner_pid: int) -> None:
        from agentbox.backends.microvm._firecracker import cgroup_dirs
        from agentbox.backends.microvm._jail import Cgroup

        self.vm = f"{sandbox}-{os.urandom(3).hex()}"
        self.dir = data_dir / "microvm" / self.vm
        self.dir.mkdir(parents=True)
        owner = {"pid": owner_pid, LABEL: sandbox, "workspace": None}
        (self.dir / "owner").write_text(json.dumps(owner))
        self.cgroup = Cgroup(self.vm, pids_max=64, memory_bytes=256 << 20)
        # The jailer's layout is the one the qemu backend makes: kill-by-name relies on it.
        assert self.cgroup.dirs == cgroup_dirs(self.vm)
        self.vmm = subprocess.Popen(["sleep", "300"])
        for d in self.cgroup.dirs:
            (d / "cgroup.procs").write_text(str(self.vmm.pid))

    def vmm_dead(self, timeout: float) -> bool:
        try:
            self.vmm.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        self.vmm.kill()
        self.vmm.wait(10)
        self.cgroup.remove()


@pytest.fixture
def fake_vm(tmp_path: Path) -> Iterator[FakeVm]:
    vm = FakeVm(tmp_path / "data", "fcbox", owner_pid=os.getpid())
    try:
        yield vm
    finally:
        vm.close()


def _wait_for(cond: object, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("backend", MICROVM_BACKENDS)
def test_kill_sandbox_kills_a_microvm_by_name(
    fake_vm: FakeVm, tmp_path: Path, backend: str
) -> None:
    """Cancel and deadline go through kill_sandbox: firecracker's VMM must die too."""
    kill_sandbox(backend, "fcbox", tmp_path / "data")
    assert fake_vm.vmm_dead(30), f"{backend}: the VMM survived kill_sandbox"
    assert fake_vm.vmm.returncode == -signal.SIGKILL
    assert fake_vm.dir.is_dir()  # killed, not reaped: its /data stays for the owner to collect


@pytest.mark.parametrize("backend", MICROVM_BACKENDS)
def test_watchdog_kills_a_microvm_at_its_deadline(
    fake_vm: FakeVm, tmp_path: Path, backend: str
) -> None:
    wd = spawn_watchdog(
        backend=backend, sandbox="fcbox", data_dir=tmp_path / "data", at=time.time() + 0.5,
        gateway_pid=None, gateway_start=None, log_file=tmp_path / "wd.log",
    )  # fmt: skip
    try:
        assert wd.wait(60) == 0
    finally:
        wd.kill()
    assert fake_vm.vmm_dead(30), (tmp_path / "wd.log").read_text()
    assert "deadline reached" in (tmp_path / "wd.log").read_text()


_OWNER = """
import sys, time
from pathlib import Path
from agentbox.launcher._watchdog import spawn_watchdog
wd = spawn_watchdog(backend=sys.argv[1], sandbox="fcbox", data_dir=Path(sys.argv[2]),
                    at=time.time() + 3600, gateway_pid=None, gateway_start=None,
                    log_file=Path(sys.argv[3]))
print(wd.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("zombie_for", [0.0, 2.0], ids=["reaped", "zombie"])
@pytest.mark.parametrize("backend", MICROVM_BACKENDS)
def test_watchdog_reaps_the_sandbox_when_its_owner_is_killed(
    tmp_path: Path, backend: str, zombie_for: float
) -> None:
    """SIGKILL the owner: its watchdog kills the VMM and removes the VM at once, also
    while the dead owner is still a zombie its parent has not reaped yet."""
    data = tmp_path / "data"
    log = tmp_path / "wd.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, backend, str(data), str(log)],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    vm = None
    wd_pid = 0
    try:
        assert owner.stdout is not None
        wd_pid = int(owner.stdout.readline())
        vm = FakeVm(data, "fcbox", owner_pid=owner.pid)
        # While the owner lives, the watchdog waits in its small form (no agentbox,
        # no pydantic loaded: the per-sandbox cost stays ~10 MB, not ~47 MB).
        maps = Path(f"/proc/{wd_pid}/maps").read_text()
        assert "pydantic_core" not in maps and "psutil" not in maps
        assert not vm.vmm_dead(1.0)
        owner.kill()
        time.sleep(zombie_for)
        owner.wait(10)
        assert vm.vmm_dead(60), log.read_text()
        assert _wait_for(lambda: not vm.dir.exists(), 60), log.read_text()
        assert _wait_for(lambda: not any(d.exists() for d in vm.cgroup.dirs), 30)
        assert "its owner is gone" in log.read_text()
        assert _wait_for(lambda: process_start(wd_pid) == 0 or _zombie(wd_pid), 30)
    finally:
        with owner:  # reaps it and closes its pipe
            owner.kill()
        if wd_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(wd_pid, signal.SIGKILL)
        if vm is not None:
            vm.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_watchdog_of_a_pid_that_is_not_its_owner_acts_at_once(tmp_path: Path) -> None:
    """An owner pid whose start time does not match (reused) counts as dead."""
    vm = FakeVm(tmp_path / "data", "fcbox", owner_pid=999_999_999)
    try:
        path = Path(sys.modules["agentbox.launcher._watchdog"].__file__ or "")
        wd = subprocess.Popen(
            [sys.executable, "-I", "-S", str(path), "--backend", "firecracker",
             "--sandbox", "fcbox", "--data-dir", str(tmp_path / "data"),
             "--at", repr(time.time() + 3600), "--owner-pid", str(os.getpid()),
             "--owner-start", str(process_start(os.getpid()) + 1)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        out, _ = wd.communicate(timeout=120)
        assert wd.returncode == 0, out
        assert b"its owner is gone" in out
        assert vm.vmm_dead(30)
        assert not vm.dir.exists()
    finally:
        vm.close()


@pytest.mark.parametrize("backend", MICROVM_BACKENDS)
def test_reap_saves_a_dead_owners_data_disk_into_its_workspace(
    tmp_path: Path, backend: str
) -> None:
    """A restarted launcher reconciles a microVM task by reaping it (qemu and firecracker
    alike): the VMM dies, what the agent wrote on /data lands in the task workspace."""
    from agentbox.backends.microvm._disks import make_data_disk
    from agentbox.launcher._watchdog import reap_sandbox

    data = tmp_path / "data"
    ws = data / "tasks" / "t1" / "workspace"
    ws.mkdir(parents=True)
    (ws / "before.txt").write_text("the repo copy\n")
    written = tmp_path / "guest-data"
    written.mkdir()
    (written / "agent-wrote.txt").write_text("made inside the VM\n")
    vm = FakeVm(data, "fcbox", owner_pid=999_999_999)  # an owner that is gone
    try:
        make_data_disk(written, vm.dir / "data.img")
        owner = json.loads((vm.dir / "owner").read_text())
        (vm.dir / "owner").write_text(json.dumps({**owner, "workspace": str(ws)}))
        reap_sandbox(backend, "fcbox", data)
        assert vm.vmm_dead(30)
        assert not vm.dir.exists()
        assert (ws / "agent-wrote.txt").read_text() == "made inside the VM\n"
        assert not (ws / "before.txt").exists()  # the workspace is the guest's /data now
    finally:
        vm.close()
