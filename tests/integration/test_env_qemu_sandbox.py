"""A frozen environment and the egress socket in a qemu microVM, against a real QEMU
(TCG here), at the backend level (issue 12 on qemu; the launcher's e2e is
tests/e2e/test_env_backends.py).

- A writable mount is copy-on-write: its source becomes a read-only ext4 disk (cached:
  a second sandbox reuses the same file) under an overlay in the guest; the guest
  reads and runs its files in place, its writes land in a layer of its own capped by
  the task's disk limit (ENOSPC past it, the host unharmed), the source and the disk
  never change, and the workspace copied back never carries the mount's files.
- A unix socket in the gateway dir besides the gateway's (the egress proxy's
  ``egress.sock``) is served in the guest at ``/run/agentbox/gw/<name>`` and reaches
  the host socket over the agent's channel; a name the host did not offer reaches nothing.

Each sandbox is made through a :class:`~sandbox_leaks.SandboxTracker`: nothing of it
may survive.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import BindMount, SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
from agentbox.boxfile import Resources
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

#: A 64 MiB disk limit: the copy-on-write layer is capped at that.
RES = Resources(memory="1GiB", cpus=1, disk="64MiB")
ENV = "/workspace/.venv"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> QemuBackend:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    base = tmp_path_factory.mktemp("qemu-env")
    settings = Settings(data_dir=base / "data", cache_dir=Settings().cache_dir)
    return QemuBackend(settings, rootfs=(info.rootfs, info.hash))


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(root.rglob("*"))
    }


class Echo:
    """A host unix-socket server answering each line with ``pong:<line>``."""

    def __init__(self, path: Path) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(8)
        self.seen = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(1024)
                self.seen += 1
                conn.sendall(b"pong:" + data)

    def close(self) -> None:
        self.srv.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen environment's directory (as setup left it, root's on the host)."""
    src = tmp_path_factory.mktemp("frozen") / ".venv"
    (src / "bin").mkdir(parents=True)
    (src / "lib").mkdir()
    (src / "bin" / "tool").write_text("#!/bin/sh\necho tool from the environment\n")
    (src / "bin" / "tool").chmod(0o755)
    (src / "lib" / "data.txt").write_text("frozen data\n")
    return src


@pytest.fixture(scope="module")
def box(
    backend: QemuBackend,
    env: Path,
    tmp_path_factory: pytest.TempPathFactory,
    module_sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> Iterator[tuple[QemuSandbox, Path, Echo]]:
    base = tmp_path_factory.mktemp("qemu-env-task")
    ws, gw = base / "workspace", base / "gw"
    ws.mkdir()
    gw.mkdir()
    (ws / "README").write_text("the repo\n")
    (ws / ".venv").mkdir()  # the mount point the launcher makes
    echo = Echo(gw / "egress.sock")
    spec = SandboxSpec(
        name="env-qemu", image="default", resources=RES, workspace=ws, gateway_dir=gw,
        mounts=(BindMount(env, ENV, read_only=False),),
    )  # fmt: skip
    try:
        sb = module_sandbox_factory(backend, backend.settings).create(spec)
        assert isinstance(sb, QemuSandbox)
        yield sb, ws, echo
        sb.destroy()
        assert not sb.vm_dir.exists() and not sb.vm.alive()
    finally:
        echo.close()


def _sh(sb: QemuSandbox, script: str) -> tuple[int, str, str]:
    res = sb.exec(["sh", "-c", script])
    return res.exit_code, res.stdout.decode(), res.stderr.decode()


def test_environment_is_read_and_run_in_place(box: tuple[QemuSandbox, Path, Echo]) -> None:
    sb = box[0]
    code, out, err = _sh(sb, f"{ENV}/bin/tool && cat {ENV}/lib/data.txt && id -u")
    assert code == 0, err
    assert out == "tool from the environment\nfrozen data\n64000\n"
    _, mounts, _ = _sh(sb, "cat /proc/mounts")
    line = next(ln.split() for ln in mounts.splitlines() if ln.split()[1] == ENV)
    assert line[2] == "overlay" and {"nosuid", "nodev"} <= set(line[3].split(","))


def test_the_layer_is_on_the_disk_not_in_guest_memory(
    box: tuple[QemuSandbox, Path, Echo],
) -> None:
    """24 MiB written into the environment leave the guest's shared memory (tmpfs pages)
    as they were: the layer is on the /data disk, not a tmpfs (which counted the guest's
    memory twice); the layer's name in /workspace shows the workload nothing."""
    sb = box[0]
    script = (
        "shmem() { awk '/^Shmem:/ {print $2}' /proc/meminfo; }; a=$(shmem); "
        f"dd if=/dev/urandom of={ENV}/layer.bin bs=1M count=24 2>&1 && sync; b=$(shmem); "
        f"rm {ENV}/layer.bin; echo grew=$((b - a)); "
        "ls -A /workspace/.agentbox-env-layer | wc -l; "
        "touch /workspace/.agentbox-env-layer/x 2>/dev/null || echo refused"
    )
    code, out, err = _sh(sb, script)
    assert code == 0, err
    grew = int(out.split("grew=")[1].split()[0])  # KiB
    assert grew < 8 * 1024, out
    assert out.rstrip().endswith(f"grew={grew}\n0\nrefused"), out


def test_writes_go_to_the_tasks_layer_and_are_capped(
    box: tuple[QemuSandbox, Path, Echo], env: Path
) -> None:
    sb = box[0]
    before = _tree(env)
    disk = next(iter(sb.vm.cfg.mount_disks))
    disk_stat = disk.stat()
    code, out, err = _sh(
        sb,
        f"echo mine > {ENV}/new.txt && echo changed >> {ENV}/lib/data.txt && "
        f"rm {ENV}/bin/tool && cat {ENV}/new.txt {ENV}/lib/data.txt",
    )
    assert code == 0, err
    assert out == "mine\nfrozen data\nchanged\n"
    # Past the disk limit (64 MiB): ENOSPC inside, nothing written on the host.
    code, _, err = _sh(sb, f"dd if=/dev/zero of={ENV}/big bs=1M count=200")
    assert code != 0 and "No space left on device" in err, err
    # The layer shares the /data disk with the workspace: free it for the next tests.
    assert _sh(sb, f"rm {ENV}/big && echo x > /workspace/room")[0] == 0
    code, out, _ = _sh(sb, "echo still alive")
    assert code == 0 and out == "still alive\n"
    assert _tree(env) == before
    after = disk.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_blocks) == (
        disk_stat.st_size, disk_stat.st_mtime_ns, disk_stat.st_blocks,
    )  # fmt: skip


def test_workspace_copied_back_never_carries_the_environment(
    box: tuple[QemuSandbox, Path, Echo],
) -> None:
    sb, ws, _ = box
    code, _, err = _sh(sb, "echo agent > /workspace/NOTES.md")
    assert code == 0, err
    sb.sync_workspace()
    assert (ws / "NOTES.md").read_text() == "agent\n"
    assert (ws / "README").read_text() == "the repo\n"
    assert not (ws / ".venv").exists() or not any((ws / ".venv").iterdir())
    assert not (ws / ".agentbox-env-layer").exists()


def test_a_dead_vms_disk_read_back_never_carries_the_layer(
    box: tuple[QemuSandbox, Path, Echo], tmp_path: Path
) -> None:
    """The host's read of a dead guest's /data disk (debugfs, no mount) prunes the
    environment's layer like lost+found: the agent's writes into .venv stay out."""
    import subprocess

    from agentbox.backends.microvm._diskexport import export_disk
    from agentbox.backends.microvm.qemu import vmm_uid

    sb = box[0]
    assert _sh(sb, f"echo mine > {ENV}/layer-file && sync")[0] == 0
    copy = tmp_path / "data.img"
    # A sparse copy (the disk is padded to its device size): the live VM's stays untouched.
    subprocess.run(["cp", "--sparse=always", sb.vm_dir / "data.img", copy], check=True)
    out = tmp_path / "out"
    export_disk(copy, out, uid=vmm_uid(sb.backend.settings, "strict"))
    assert (out / "README").is_file()
    assert not (out / ".agentbox-env-layer").exists()
    assert not list(out.rglob("layer-file"))


def test_extra_socket_reaches_the_host_and_only_it(
    box: tuple[QemuSandbox, Path, Echo],
) -> None:
    sb, _, echo = box
    script = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect('/run/agentbox/gw/egress.sock')\n"
        "s.sendall(b'ping')\n"
        "print(s.recv(100).decode())\n"
    )
    res = sb.exec(["python3", "-c", script])
    assert res.exit_code == 0, res.stderr
    assert res.stdout == b"pong:ping\n" and echo.seen >= 1
    code, out, _ = _sh(sb, "ls -l /run/agentbox/gw/")
    assert code == 0 and "egress.sock" in out and "gateway.sock" not in out


def test_a_second_sandbox_reuses_the_cached_disk(
    backend: QemuBackend,
    env: Path,
    box: tuple[QemuSandbox, Path, Echo],
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    first = next(iter(box[0].vm.cfg.mount_disks))
    cow = BindMount(env, "/home/agent/.cache/tool", read_only=False)
    # Its name is no prefix of the first one's (the guard looks for sockets naming it).
    spec = SandboxSpec(name="env-qemu-reuse", image="default", resources=RES, mounts=(cow,))
    with sandbox_factory(backend, backend.settings).create(spec) as sb:
        assert next(iter(sb.vm.cfg.mount_disks)) == first
        code, out, err = _sh(sb, "cat /home/agent/.cache/tool/lib/data.txt; stat -c %u "
                                 "/home/agent/.cache")  # fmt: skip
        assert code == 0, err
        assert out == "frozen data\n64000\n"
    assert os.path.exists(first)


def test_deep_data_dir_and_long_names_still_connect(
    backend: QemuBackend,
    tmp_path_factory: pytest.TempPathFactory,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    """A VM dir deeper than a unix socket path may be (107 bytes): the host still
    reaches the agent and QMP (it failed with "QEMU's agent socket never appeared" for
    the setup sandbox of a task with a long id)."""
    deep = tmp_path_factory.mktemp("d") / ("deep-" * 12)
    settings = Settings(data_dir=deep / "data", cache_dir=backend.settings.cache_dir)
    long_backend = QemuBackend(settings, rootfs=backend._rootfs)
    spec = SandboxSpec(name="agentbox-setup-" + "x" * 40, image="default", resources=RES)
    with sandbox_factory(long_backend, settings).create(spec) as sb:
        assert len(str(sb.vm.agent_socket)) > 107 and len(str(sb.vm.qmp_socket)) > 107
        code, out, _ = _sh(sb, "echo reached")
        assert code == 0 and out == "reached\n"
