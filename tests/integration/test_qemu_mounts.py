"""Declared read-only mounts in qemu microVMs, against a real QEMU (TCG here).

Each mount is its own ext4 disk attached ``readonly=on`` and mounted by the
guest agent ``ro,nosuid,nodev`` before any command. One restored sandbox
(strict isolation: the VMM's uid owns none of our files) with two mounts is
shared by the module; one cold boot checks the other start path. Each sandbox is
made through a :class:`~sandbox_leaks.SandboxTracker`: nothing of it may survive.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import BindMount, SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.errors import UnsupportedError
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

RES = Resources(memory="1GiB", cpus=1)
SECRET = b"host secret outside the mount\n"
#: In the image (a directory of its read-only root), and on the guest's /home/agent tmpfs.
IMAGE_TARGET, TMPFS_TARGET = "/srv", "/home/agent/tools"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> QemuBackend:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path_factory.mktemp("qemu-mnt-data"))
    return QemuBackend(settings, rootfs=(info.rootfs, info.hash))


def _manifest(root: Path) -> dict[str, tuple[int, int, int, int, str]]:
    """Every entry under ``root``: mode, uid, size, mtime and content hash (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = ""
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = str(p.readlink())
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns,
                                             digest)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Two host dirs: one with hostile entries (setuid binary, device, FIFO, socket, link out)."""
    base = tmp_path_factory.mktemp("mount-src")
    secret = base / "secret"
    secret.write_bytes(SECRET)
    a, b = base / "a", base / "b"
    (a / "sub").mkdir(parents=True)
    (a / "hello.txt").write_text("hello from the host\n")
    (a / "sub/deep.txt").write_text("deep\n")
    (a / "private").write_text("owner only\n")
    (a / "private").chmod(0o600)
    shutil.copy2("/usr/bin/id", a / "id-suid")
    os.chown(a / "id-suid", 0, 0)
    (a / "id-suid").chmod(0o4755)
    os.mknod(a / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(a / "fifo")
    os.mknod(a / "sock", 0o666 | stat.S_IFSOCK)
    (a / "link-out").symlink_to(secret)
    (a / "link-in").symlink_to("hello.txt")
    b.mkdir()
    (b / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    (b / "tool.sh").chmod(0o755)
    yield a, b


@pytest.fixture(scope="module")
def before(sources: tuple[Path, Path]) -> list[dict[str, tuple[int, int, int, int, str]]]:
    return [_manifest(s) for s in sources]


@pytest.fixture(scope="module")
def sandbox(
    backend: QemuBackend,
    sources: tuple[Path, Path],
    before: list[dict[str, tuple[int, int, int, int, str]]],
    module_sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> Iterator[QemuSandbox]:
    a, b = sources
    # Not "mounts": the leak guard looks for processes naming the sandbox, and a
    # `cat /proc/self/mounts` anywhere on the host would name that one.
    spec = SandboxSpec(
        name="qemu-mounts", image="default", resources=RES, isolation="strict",
        mounts=(BindMount(a, IMAGE_TARGET), BindMount(b, TMPFS_TARGET)),
    )  # fmt: skip
    sb = module_sandbox_factory(backend, backend.settings).create(spec)
    assert isinstance(sb, QemuSandbox) and sb.restored
    yield sb
    sb.destroy()
    assert not sb.vm_dir.exists() and not sb.vm.alive()


def _sh(sb: QemuSandbox, script: str) -> tuple[int, str, str]:
    res = sb.exec(["sh", "-c", script])
    return res.exit_code, res.stdout.decode(), res.stderr.decode()


def test_files_are_readable_at_their_targets(sandbox: QemuSandbox) -> None:
    code, out, _ = _sh(
        sandbox,
        f"cat {IMAGE_TARGET}/hello.txt {IMAGE_TARGET}/sub/deep.txt {IMAGE_TARGET}/private "
        f"{IMAGE_TARGET}/link-in; {TMPFS_TARGET}/tool.sh; stat -c %u {IMAGE_TARGET}/private",
    )
    assert code == 0
    assert out == "hello from the host\ndeep\nowner only\nhello from the host\ntool ran\n64000\n"


def test_writing_fails_read_only(sandbox: QemuSandbox) -> None:
    for target in (IMAGE_TARGET, TMPFS_TARGET):
        code, _, err = _sh(sandbox, f"echo x > {target}/hello.txt")
        assert code != 0 and "Read-only file system" in err, err
        code, _, err = _sh(sandbox, f"mkdir {target}/new")
        assert code != 0 and "Read-only file system" in err, err


def test_mounts_are_ro_nosuid_nodev(sandbox: QemuSandbox) -> None:
    _, out, _ = _sh(sandbox, "cat /proc/mounts")
    lines = {ln.split()[1]: ln.split() for ln in out.splitlines()}
    for target in (IMAGE_TARGET, TMPFS_TARGET):
        assert target in lines, out
        fstype, opts = lines[target][2], lines[target][3].split(",")
        assert fstype == "ext4"
        assert {"ro", "nosuid", "nodev"} <= set(opts), opts


def test_root_in_the_guest_cannot_make_them_writable(sandbox: QemuSandbox) -> None:
    """Even the guest's root (through the agent) cannot remount or write the disk."""
    assert sandbox.session is not None
    probe = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
dev = [ln.split()[0] for ln in open("/proc/mounts") if ln.split()[1] == "{IMAGE_TARGET}"][0]
rc = libc.mount(b"none", b"{IMAGE_TARGET}", None, 32, None)  # MS_REMOUNT, rw
print("remount", rc, ctypes.get_errno())
try:
    fd = os.open(dev, os.O_WRONLY)
    os.write(fd, b"x" * 4096)
    os.fsync(fd)
    print("devwrite ok")
except OSError as exc:
    print("devwrite", exc.errno)
try:
    open("{IMAGE_TARGET}/hello.txt", "a").write("x")
    print("filewrite ok")
except OSError as exc:
    print("filewrite", exc.errno)
print(os.getuid(), open("{IMAGE_TARGET}/hello.txt").read().strip())
"""
    res = sandbox.session.exec(
        ["python3", "-c", probe], env={"PATH": "/usr/bin:/bin"}, cwd="/", uid=0, timeout=60
    )
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0].split()[:2] == ["remount", "-1"], lines
    assert lines[1].startswith("devwrite ") and lines[1] != "devwrite ok", lines
    assert lines[2] == "filewrite 30", lines  # EROFS
    assert lines[3] == "0 hello from the host", lines
    _, out, _ = _sh(sandbox, "cat /proc/mounts")
    opts = next(ln.split()[3] for ln in out.splitlines() if ln.split()[1] == IMAGE_TARGET)
    assert opts.split(",")[0] == "ro"


def test_setuid_devices_fifos_sockets_do_not_work(sandbox: QemuSandbox) -> None:
    code, out, err = _sh(
        sandbox,
        f"cd {IMAGE_TARGET}; ./id-suid -u; stat -c %a id-suid; "
        "for f in null fifo sock; do test -e $f -o -L $f && echo present $f; done; true",
    )
    assert code == 0, err
    euid, mode = out.split()[:2]
    assert euid == "64000"  # not 0: the bit is gone (and the mount is nosuid)
    assert int(mode, 8) & 0o6000 == 0
    assert "present" not in out


def test_links_are_not_followed_on_the_host(sandbox: QemuSandbox) -> None:
    code, out, _ = _sh(sandbox, f"readlink {IMAGE_TARGET}/link-out; cat {IMAGE_TARGET}/link-out")
    assert SECRET.decode() not in out
    assert code != 0  # it points at a host path that does not exist in the guest


def test_jail_holds_exactly_the_declared_disks(sandbox: QemuSandbox) -> None:
    pid = sandbox.vm.vmm_pid()
    root = Path(f"/proc/{pid}/root")
    assert sorted(p.name for p in (root / "vm").iterdir()) == [
        "data.img", "initramfs", "m0.img", "m1.img", "root.img", "run", "vmlinux",
    ]  # fmt: skip
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    drives = [a.decode() for a in cmdline if a.startswith(b"id=m")]
    assert len(drives) == 2 and all("readonly=on" in d for d in drives), drives


def test_host_sources_are_unchanged(
    sandbox: QemuSandbox,
    sources: tuple[Path, Path],
    before: list[dict[str, tuple[int, int, int, int, str]]],
) -> None:
    _sh(sandbox, f"rm -rf {IMAGE_TARGET}/* {TMPFS_TARGET}/*; sync")
    assert [_manifest(s) for s in sources] == before


@pytest.mark.slow
def test_cold_boot_mounts_too(
    backend: QemuBackend,
    sources: tuple[Path, Path],
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    cold = QemuBackend(backend.settings, cold=True, rootfs=backend._rootfs)
    spec = SandboxSpec(name="mounts-cold", image="default", resources=RES,
                       mounts=(BindMount(sources[1], "/tmp/deps/tools"),))  # fmt: skip
    with sandbox_factory(cold, cold.settings).create(spec) as sb:
        assert not sb.restored
        code, out, _ = _sh(sb, "/tmp/deps/tools/tool.sh; grep ' /tmp/deps/tools ' /proc/mounts")
        assert code == 0 and out.startswith("tool ran\n")
        assert "ro,nosuid,nodev" in out
        code, _, err = _sh(sb, "touch /tmp/deps/tools/x")
        assert code != 0 and "Read-only file system" in err


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("/opt/not-in-image", "/opt/not-in-image is missing"),
        ("/var/run/x", "/var/run is not a plain directory"),  # a symlink in the image
        ("/workspace/deps", "lies in the workspace"),
        ("/opt/agentbox/x", "guest agent"),
    ],
)
def test_bad_targets_are_refused_before_anything_starts(
    backend: QemuBackend,
    sources: tuple[Path, Path],
    target: str,
    why: str,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    spec = SandboxSpec(name="mounts-bad", image="default", resources=RES,
                       mounts=(BindMount(sources[1], target),))  # fmt: skip
    vms = backend.settings.data_dir / "microvm"
    seen = set(vms.iterdir()) if vms.is_dir() else set()
    with pytest.raises(UnsupportedError, match=why) as ei:
        sandbox_factory(backend, backend.settings).create(spec)
    assert target in str(ei.value) and ei.value.fix
    assert (set(vms.iterdir()) if vms.is_dir() else set()) == seen


def test_nested_or_duplicate_targets_are_refused(
    backend: QemuBackend, sources: tuple[Path, Path]
) -> None:
    a, b = sources
    for targets in (("/srv", "/srv/x"), ("/srv", "/srv")):
        spec = SandboxSpec(name="mounts-bad", image="default",
                           mounts=(BindMount(a, targets[0]), BindMount(b, targets[1])))  # fmt: skip
        with pytest.raises(UnsupportedError, match="mount target"):
            backend.check(spec)
