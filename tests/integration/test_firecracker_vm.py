"""The firecracker backend: the guest side under QEMU here, the whole VM where Firecracker runs.

On this host there is no Firecracker binary and KVM cannot boot a stock kernel,
so the live tests (marked ``firecracker``) skip with the reason the backend's
own probe gives. What does not need a live Firecracker runs for real: the
firecracker initramfs (vsock modules added) boots Debian's cloud kernel under
QEMU and loads every module. Every sandbox is made through a
:class:`~sandbox_leaks.SandboxTracker`: nothing of it may survive.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm._disks import make_data_disk
from agentbox.backends.microvm._firecracker import (
    JAIL_FILES,
    VSOCK_MODULES,
    ensure_vsock_modules,
    place_files,
)
from agentbox.backends.microvm._guest import KernelFacts
from agentbox.backends.microvm._initramfs import MARKER, ensure_initramfs
from agentbox.backends.microvm._kernel import ensure_kernel
from agentbox.backends.microvm._vm import Vm, VmConfig
from agentbox.backends.microvm.firecracker import (
    FirecrackerBackend,
    FirecrackerSandbox,
    FirecrackerVm,
    facility,
)
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.errors import GuestError
from sandbox_leaks import SandboxTracker

RES = Resources(memory="1GiB", cpus=1)


@pytest.mark.qemu
@pytest.mark.slow
def test_the_vsock_initramfs_loads_every_module_in_the_real_kernel() -> None:
    """Booted under QEMU (TCG here): /init insmods the base and vsock modules, then the
    probe marker; a module that fails to load reboots before the marker. A bare VM,
    no backend's sandbox: ``vm.kill()`` waits for its QEMU to end."""
    settings = Settings()
    kernel = ensure_kernel(settings)
    vsock = ensure_vsock_modules(settings, kernel)
    assert [p.stem for p in vsock] == list(VSOCK_MODULES)
    initramfs = ensure_initramfs(settings, kernel, extra_modules=vsock)
    assert initramfs != ensure_initramfs(settings, kernel), "the qemu archive stays as it was"
    blob = initramfs.read_bytes()
    for m in VSOCK_MODULES:
        assert f"lib/modules/{m}.ko".encode() in blob
    assert " ".join(VSOCK_MODULES).encode() in blob  # in /init's insmod loop

    with tempfile.TemporaryDirectory(prefix="agentbox-fc-probe-") as tmp:
        # An empty file of our own, not /dev/null: QEMU takes OFD locks on its disks, and
        # any other holder of a lock on the shared /dev/null inode would refuse the boot.
        empty = Path(tmp) / "empty.img"
        empty.write_bytes(b"")
        cfg = VmConfig(
            name=f"fc-probe-{os.getpid()}", kernel=kernel, initramfs=initramfs,
            root_disk=empty, data_disk=None, run_dir=Path(tmp) / "run",
            accel="tcg", marker=True, jail=False, use_cgroup=False,
            cmdline_extra=("agentbox_probe=1", "agentbox_transport=vsock"),
        )  # fmt: skip
        r, w = os.pipe()
        vm = Vm(cfg)
        try:
            vm.start(stdout_fd=w)
            os.close(w)
            w = -1
            out = b""
            end = time.monotonic() + 120
            while MARKER.encode() not in out and time.monotonic() < end:
                ready, _, _ = select.select([r], [], [], 1.0)
                if ready:
                    chunk = os.read(r, 65536)
                    if not chunk:
                        break
                    out = (out + chunk)[-65536:]
            assert MARKER.encode() in out, f"no marker: {out[-2000:]!r} {vm.log_tail()}"
            assert b"agentbox-init: insmod" not in out
        finally:
            if w >= 0:
                os.close(w)
            os.close(r)
            vm.kill()


@pytest.mark.qemu
def test_a_vm_jail_from_the_real_artifacts(tmp_path: Path) -> None:
    """The backend's VM shape and jail, made from the real kernel, initramfs and root
    disk (no VMM is started): vsock initramfs, KVM, a uid that is not root, the jail
    holding exactly the declared files, the cached originals left as they were."""
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path / "data")
    backend = FirecrackerBackend(settings, rootfs=(info.rootfs, info.hash))
    vm_dir = tmp_path / "vm"
    vm_dir.mkdir()
    data = make_data_disk(None, vm_dir / "data.img", uid=64000)
    spec = SandboxSpec(name="fc-shape", image="default", resources=RES, isolation="standard")
    cfg = backend.base_config(spec, vm_dir / "run", data)
    assert cfg.accel == "kvm" and cfg.uid == cfg.gid != 0
    # Always a cold boot: /init mounts /data before the agent starts, as for qemu --cold.
    assert "agentbox_data=1" in cfg.cmdline_extra
    assert cfg.initramfs != ensure_initramfs(Settings(), cfg.kernel)
    vm = FirecrackerVm(cfg, firecracker=Path("/opt/fc/firecracker"),
                       jailer=Path("/opt/fc/jailer"), vm_dir=vm_dir)  # fmt: skip
    shared = [cfg.kernel.vmlinux, cfg.initramfs, cfg.root_disk]
    before = [(p.stat().st_uid, p.stat().st_mode) for p in shared]
    place_files(vm.chroot, vm.fc_spec())
    assert sorted(vm.chroot.iterdir()) == sorted(vm.chroot / n for n in JAIL_FILES)
    assert [(p.stat().st_uid, p.stat().st_mode) for p in shared] == before
    assert (vm.chroot / "root.img").stat().st_ino == cfg.root_disk.stat().st_ino
    argv = vm.argv()
    assert argv[argv.index("--uid") + 1] == str(cfg.uid)
    assert argv[argv.index("--chroot-base-dir") + 1] == str(vm_dir / "jail")
    assert vm.vsock_socket == vm.chroot / "v.sock"
    boot = json.loads((vm.chroot / "config.json").read_text())["boot-source"]["boot_args"]
    assert {"agentbox_data=1", "agentbox_transport=vsock"} <= set(boot.split())


# -- live Firecracker (skips here, with the backend's own reason)


@pytest.fixture(scope="module")
def fc_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    settings = Settings()
    fac = facility(settings)
    if not fac.ok:
        pytest.skip(f"firecracker: {fac.detail} (fix: {fac.fix})")
    data = tmp_path_factory.mktemp("fc-data")
    return Settings(data_dir=data, firecracker_binary=settings.firecracker_binary)


@pytest.fixture(scope="module")
def fc_backend(fc_settings: Settings) -> FirecrackerBackend:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    return FirecrackerBackend(fc_settings, rootfs=(info.rootfs, info.hash))


@pytest.fixture(scope="module")
def fc_sandbox(
    fc_backend: FirecrackerBackend,
    module_sandbox_factory: Callable[[FirecrackerBackend, Settings], SandboxTracker],
) -> Iterator[FirecrackerSandbox]:
    ws = Path(tempfile.mkdtemp(prefix="fc-ws-", dir=fc_backend.settings.data_dir))
    (ws / "hello.txt").write_text("from the host\n")
    spec = SandboxSpec(name="fc-it", image="default", resources=RES, workspace=ws, deadline=600)
    try:
        sb = module_sandbox_factory(fc_backend, fc_backend.settings).create(spec)
        assert isinstance(sb, FirecrackerSandbox)
        yield sb
        sb.destroy()
    finally:
        shutil.rmtree(ws, ignore_errors=True)


@pytest.mark.firecracker
def test_exec_runs_in_the_guest_kernel(fc_sandbox: FirecrackerSandbox) -> None:
    res = fc_sandbox.exec(["sh", "-c", "cat /workspace/hello.txt; id -u; uname -r"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0] == "from the host"
    assert lines[1] == str(fc_sandbox.spec.uid)
    assert lines[2] != os.uname().release
    assert fc_sandbox.exec(["sh", "-c", "exit 7"]).exit_code == 7


@pytest.mark.firecracker
def test_the_per_command_check_refuses_the_hosts_kernel(fc_sandbox: FirecrackerSandbox) -> None:
    session = fc_sandbox.session
    assert session is not None
    real = session.host
    session.host = KernelFacts(str(session.last_check.get("release")), real.boot_id)
    try:
        with pytest.raises(GuestError, match="host's kernel"):
            fc_sandbox.exec(["true"])
    finally:
        session.host = real


@pytest.mark.firecracker
def test_posture_read_off_the_running_firecracker(fc_sandbox: FirecrackerSandbox) -> None:
    p = fc_sandbox.posture()
    assert p.backend == "firecracker"
    assert p.ok, [c for c in p.checks if not c.ok]


@pytest.mark.firecracker
def test_the_jail_holds_only_the_declared_files(fc_sandbox: FirecrackerSandbox) -> None:
    entries = fc_sandbox.jail_contents()
    jailer_own = {fc_sandbox.vm.firecracker.name, "dev", "v.sock", "firecracker.pid"}
    extra = {e for e in entries if e.split("/")[0] not in set(JAIL_FILES) | jailer_own}
    assert not extra, extra
    devs = {e for e in entries if e.startswith("dev/")}
    assert devs <= {"dev/kvm", "dev/net", "dev/net/tun", "dev/urandom", "dev/userfaultfd"}


@pytest.mark.firecracker
@pytest.mark.slow
def test_run_writes_the_workspace_back(
    fc_backend: FirecrackerBackend,
    sandbox_factory: Callable[[FirecrackerBackend, Settings], SandboxTracker],
) -> None:
    ws = Path(tempfile.mkdtemp(prefix="fc-ws-", dir=fc_backend.settings.data_dir))
    tracker = sandbox_factory(fc_backend, fc_backend.settings)
    try:
        spec = SandboxSpec(name="fc-run", image="default", resources=RES, workspace=ws)
        res = tracker.run(spec, ["sh", "-c", "echo made > /workspace/out.txt"])
        assert res.exit_code == 0, res.stderr
        assert (ws / "out.txt").read_text() == "made\n"
        assert not list((fc_backend.settings.data_dir / "microvm").glob("fc-run-*"))
    finally:
        shutil.rmtree(ws, ignore_errors=True)
