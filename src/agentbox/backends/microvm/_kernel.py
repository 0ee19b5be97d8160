"""The guest kernel: Debian's cloud kernel, fetched with apt and unpacked to a PVH vmlinux.

``apt-get download`` fetches ``linux-image-<version>-cloud-amd64`` (the package
the ``linux-image-cloud-amd64`` metapackage depends on) into the cache; the
bzImage's compressed payload (LZ4 on Debian 12, found through the setup
header's ``payload_offset``/``payload_length``, as the kernel's own
``extract-vmlinux`` does by scanning) is decompressed to the ELF ``vmlinux``
that QEMU's ``-M microvm`` boots through its PVH entry note. The modules the
initramfs needs come from the same package.
"""

from __future__ import annotations

import fcntl
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ImageError

log = get_logger(__name__)

METAPACKAGE = "linux-image-cloud-amd64"

#: Magic → decompressor argv (reads stdin, writes stdout).
_DECOMPRESSORS: tuple[tuple[bytes, tuple[str, ...]], ...] = (
    (b"\x02\x21\x4c\x18", ("lz4", "-dc")),
    (b"\x1f\x8b\x08", ("gzip", "-dc")),
    (b"\xfd7zXZ\x00", ("xz", "-dc")),
    (b"\x28\xb5\x2f\xfd", ("zstd", "-dc")),
    (b"\x5d\x00\x00", ("xz", "--format=lzma", "-dc")),
)


@dataclass(frozen=True)
class Kernel:
    """An unpacked guest kernel: its release, the PVH vmlinux and its modules dir."""

    release: str
    vmlinux: Path
    modules: Path


def decompress_bzimage(bzimage: bytes) -> bytes:
    """The ELF vmlinux inside a bzImage. Raises ImageError if it is not one."""
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        raise ImageError("not a bzImage (no HdrS setup header)")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = bzimage[start : start + length]
    argv = next((a for magic, a in _DECOMPRESSORS if payload.startswith(magic)), None)
    if argv is None:
        raise ImageError(f"bzImage payload has an unknown compression: {payload[:6].hex()}")
    # Decompressors complain about the 4-byte size trailer after the stream;
    # what counts is a whole ELF on stdout, checked below.
    proc = subprocess.run(list(argv), input=payload, capture_output=True, timeout=120, check=False)
    elf = proc.stdout
    if not elf.startswith(b"\x7fELF") or len(elf) < 64:
        raise ImageError(f"{argv[0]} did not yield an ELF vmlinux: {proc.stderr[-300:]!r}")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    if shoff + shentsize * shnum > len(elf):
        raise ImageError("decompressed vmlinux is truncated")
    return elf


def _resolve_package() -> str:
    res = _proc.run(["apt-cache", "depends", METAPACKAGE], timeout=60)
    for line in res.stdout.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip()
    raise ImageError(f"cannot resolve {METAPACKAGE} to a kernel package (apt-get update?)")


def ensure_kernel(settings: Settings) -> Kernel:
    """The cached guest kernel, fetched and unpacked on first use."""
    root = settings.cache_dir / "microvm" / "kernel"
    root.mkdir(parents=True, exist_ok=True)
    current = root / "current"
    if (current / "vmlinux").is_file() and (current / "release").is_file():
        return _load(current.resolve())
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (current / "vmlinux").is_file():
            return _load(current.resolve())
        try:
            return _fetch(root)
        except AgentboxError:
            raise
        except OSError as exc:
            raise ImageError(f"cannot unpack the guest kernel: {exc}") from exc


def _load(d: Path) -> Kernel:
    release = (d / "release").read_text().strip()
    return Kernel(release, d / "vmlinux", d / "modules")


def _fetch(root: Path) -> Kernel:
    package = _resolve_package()
    release = package.removeprefix("linux-image-")
    log.info("fetching guest kernel", package=package)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        t = Path(tmp)
        # apt drops privileges to _apt when it can; a root-only dir just makes it warn.
        _proc.run(["apt-get", "download", package], cwd=t, timeout=600)
        debs = list(t.glob("*.deb"))
        if len(debs) != 1:
            raise ImageError(f"apt-get download {package} left {len(debs)} .deb files")
        _proc.run(["dpkg-deb", "-x", debs[0], t / "x"], timeout=300)
        bz = next((t / "x/boot").glob("vmlinuz-*"), None)
        if bz is None:
            raise ImageError(f"{package} holds no /boot/vmlinuz")
        out = root / release
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        (out / "vmlinux").write_bytes(decompress_bzimage(bz.read_bytes()))
        mods = next((t / "x/lib/modules").iterdir())
        (out / "modules").mkdir()
        for ko in mods.rglob("*.ko"):
            if ko.stem in _WANTED:
                (out / "modules" / ko.name).write_bytes(ko.read_bytes())
        (out / "release").write_text(mods.name + "\n")
    tmp_link = root / ".current.tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(release)
    tmp_link.replace(root / "current")
    return _load(out)


#: Modules the initramfs loads, in dependency order (6.1 cloud builds them as modules).
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console")
_WANTED = frozenset(MODULES)
#: Loaded after the base modules by the qemu backend: a frozen environment's disk is the
#: read-only lower layer of an overlay in the guest.
OVERLAY_MODULES = ("overlay",)


def ensure_modules(settings: Settings, kernel: Kernel, names: tuple[str, ...]) -> list[Path]:
    """The ``.ko`` files ``names`` of ``kernel``, fetched from its package on first use.

    :func:`ensure_kernel` keeps only :data:`MODULES`; others come from the same Debian
    package (``linux-image-<release>``) and are added next to them, once.
    """
    del settings  # the kernel's own dir holds them
    want = [kernel.modules / f"{m}.ko" for m in names]
    if all(p.is_file() for p in want):
        return want
    root = kernel.vmlinux.parent.parent
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(p.is_file() for p in want):
            return want
        package = f"linux-image-{kernel.release}"
        log.info("fetching guest modules", package=package, modules=list(names))
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            t = Path(tmp)
            _proc.run(["apt-get", "download", package], cwd=t, timeout=600)
            debs = list(t.glob("*.deb"))
            if len(debs) != 1:
                raise ImageError(f"apt-get download {package} left {len(debs)} .deb files")
            _proc.run(["dpkg-deb", "-x", debs[0], t / "x"], timeout=300)
            found = {ko.stem: ko for ko in (t / "x/lib/modules").rglob("*.ko")}
            for m, dest in zip(names, want, strict=True):
                if m not in found:
                    raise ImageError(f"{package} has no {m}.ko")
                tmp_dest = dest.with_suffix(".ko.tmp")
                shutil.copyfile(found[m], tmp_dest)
                tmp_dest.replace(dest)
    return want
