"""Pure parts of the microVM build: bzImage unpacking, the cpio writer, argv and jail."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from agentbox.backends.microvm._initramfs import INIT_SCRIPT, _has_interp, build_cpio
from agentbox.backends.microvm._jail import JailSpec, jail_argv
from agentbox.backends.microvm._kernel import Kernel, decompress_bzimage
from agentbox.backends.microvm._vm import SANDBOX_FLAGS, VmConfig, qemu_argv
from agentbox.errors import ImageError


def _fake_bzimage(payload: bytes, setup_sects: int = 4) -> bytes:
    head = bytearray((setup_sects + 1) * 512)
    head[0x1F1] = setup_sects
    head[0x202:0x206] = b"HdrS"
    struct.pack_into("<II", head, 0x248, 0, len(payload))
    return bytes(head) + payload


def test_bzimage_payload_is_found_through_the_setup_header() -> None:
    elf = b"\x7fELF" + b"\0" * 60  # e_shoff = 0, e_shnum = 0: a minimal valid header
    gz = subprocess.run(["gzip", "-c"], input=elf, capture_output=True, check=True).stdout
    assert decompress_bzimage(_fake_bzimage(gz)) == elf


@pytest.mark.parametrize(
    "blob",
    [b"MZ" + b"\0" * 1000, _fake_bzimage(b"\x00\x01unknown"), _fake_bzimage(b"\x1f\x8b\x08junk")],
)
def test_bad_bzimages_are_refused(blob: bytes) -> None:
    with pytest.raises(ImageError):
        decompress_bzimage(blob)


def test_cpio_is_readable_by_cpio(tmp_path: Path) -> None:
    blob = build_cpio(
        {"init": (0o100755, b"#!/bin/sh\n"), "bin/sh": (0o120777, b"busybox")}, ["bin", "dev"]
    )
    listing = subprocess.run(
        ["cpio", "-it", "--quiet"], input=blob, capture_output=True, check=True
    ).stdout.decode()
    assert set(listing.split()) == {"bin", "dev", "dev/console", "init", "bin/sh"}
    subprocess.run(["cpio", "-id", "--quiet"], input=blob, cwd=tmp_path, check=True)
    assert (tmp_path / "bin/sh").readlink() == Path("busybox")
    assert (tmp_path / "init").stat().st_mode & 0o777 == 0o755


def test_init_mounts_root_readonly_and_binds_agent_readonly() -> None:
    assert "-o ro,noload,nodev" in INIT_SCRIPT
    assert "remount,bind,ro /newroot/opt/agentbox/vm" in INIT_SCRIPT
    assert "ip link set lo up" in INIT_SCRIPT


def test_interp_detection() -> None:
    assert _has_interp(Path("/bin/ls").read_bytes())
    assert not _has_interp(Path("/usr/bin/busybox").read_bytes())


def _cfg(tmp_path: Path, **kw: object) -> VmConfig:
    k = Kernel("6.1.0-test", tmp_path / "vmlinux", tmp_path / "mods")
    base: dict[str, object] = dict(
        name="t", kernel=k, initramfs=tmp_path / "i.cpio", root_disk=tmp_path / "r.img",
        data_disk=tmp_path / "d.img", run_dir=tmp_path / "run",
    )  # fmt: skip
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def test_qemu_argv_has_no_network_and_full_seccomp(tmp_path: Path) -> None:
    argv = qemu_argv(_cfg(tmp_path))
    joined = " ".join(argv)
    assert argv[argv.index("-sandbox") + 1] == SANDBOX_FLAGS
    for flag in ("obsolete=deny", "elevateprivileges=deny", "spawn=deny", "resourcecontrol=deny"):
        assert flag in SANDBOX_FLAGS
    assert "-nodefaults" in argv and "-no-user-config" in argv
    assert "-netdev" not in argv and "-nic" not in argv and "guestfwd" not in joined
    assert "readonly=on" in argv[argv.index("-drive") + 1]
    assert "/vm/run/agent.sock" in joined and str(tmp_path) not in joined
    assert "tsc_early_khz=" in joined and "tsc=reliable" in joined
    assert "-incoming" not in argv


def test_restore_argv_differs_only_by_incoming(tmp_path: Path) -> None:
    cold = qemu_argv(_cfg(tmp_path))
    warm = qemu_argv(_cfg(tmp_path, incoming_fd=7, data_disk=tmp_path / "other.img"))
    assert warm[: len(cold)] == cold
    assert warm[len(cold) :] == ["-S", "-incoming", "fd:7"]


def test_template_and_restore_map_the_snapshot_ram(tmp_path: Path) -> None:
    tmpl = qemu_argv(_cfg(tmp_path, ram_file=tmp_path / "ram.img"))
    warm = qemu_argv(_cfg(tmp_path, incoming_fd=7, ram_fd=9))
    for argv in (tmpl, warm):
        assert "memory-backend=ram" in argv[argv.index("-M") + 1]
        assert argv[argv.index("-m") + 1] == "512M"
    backend = {a for a in tmpl + warm if a.startswith("memory-backend-file")}
    # the template writes its RAM into its file (bound in the jail); a restore maps the
    # passed memfd private: its writes never reach the file another VM reads
    assert backend == {
        "memory-backend-file,id=ram,size=512M,mem-path=/vm/ram,share=on",
        "memory-backend-file,id=ram,size=512M,mem-path=/proc/self/fd/9,share=off",
    }
    assert warm[-3:] == ["-S", "-incoming", "defer"]  # x-ignore-shared is set first, over QMP


def test_kvm_argv(tmp_path: Path) -> None:
    argv = qemu_argv(_cfg(tmp_path, accel="kvm"))
    assert argv[argv.index("-accel") + 1] == "kvm"
    assert argv[argv.index("-cpu") + 1] == "host"


def test_jail_argv_binds_only_declared_files(tmp_path: Path) -> None:
    spec = JailSpec(
        ((tmp_path / "k", "/vm/vmlinux"),), ((tmp_path / "run", "/vm/run"),), 1234, 1234
    )
    argv = jail_argv(spec, ["qemu-system-x86_64", "-x"])
    binds = [(argv[i], argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a.endswith("bind")]
    assert binds == [
        ("--ro-bind", "/usr", "/usr"),
        ("--ro-bind", str(tmp_path / "k"), "/vm/vmlinux"),
        ("--bind", str(tmp_path / "run"), "/vm/run"),
    ]
    for ns in ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"):
        assert ns in argv
    assert "--die-with-parent" in argv and "--dev-bind" not in argv
    sp = argv.index("setpriv")
    assert "--reuid=1234" in argv[sp:] and "--no-new-privs" in argv[sp:]
    assert "--bounding-set=-all" in argv[sp:]
    assert argv[-2:] == ["qemu-system-x86_64", "-x"]


def test_prune_cache_keeps_the_most_recently_used(tmp_path: Path) -> None:
    import os

    from agentbox.backends.microvm._disks import prune_cache

    for i in range(6):
        p = tmp_path / f"root-{i}.img"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_text("kept: not matched")
    prune_cache(tmp_path, "root-*.img", 3, used=tmp_path / "root-0.img")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.txt", "root-0.img", "root-4.img", "root-5.img",
    ]  # fmt: skip
