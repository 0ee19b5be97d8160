"""The initramfs: busybox, the virtio modules, ``/init`` and the guest agent.

``/init`` (PID 1) loads the modules, mounts the image's root read-only from the
disk labelled ``agentbox-root``, puts tmpfs on ``/tmp``, ``/run`` and
``$HOME``, binds this initramfs's ``/agentbox`` read-only at
``/opt/agentbox/vm`` (the workload cannot overwrite the agent; the image's
own ``/opt/agentbox`` stays visible), brings ``lo`` up (there is no other
interface), and runs the agent (precompiled, under ``no_new_privs``) in a
chroot of the root with the image's ``python3``. ``/data`` is mounted here
only on a cold boot (``agentbox_data=1``); otherwise the agent mounts it at
``hello``, so a snapshot taken before then holds nothing of any workspace.

With ``agentbox_marker=1`` on the kernel command line ``/init`` instead prints
:data:`MARKER` from the image's python and powers off: the bare-boot baseline
of the benchmark and the KVM probe use it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import py_compile
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agentbox.backends.microvm._kernel import MODULES, Kernel
from agentbox.config import Settings
from agentbox.errors import ImageError
from agentbox.guest import wire as wire_module

MARKER = "AGENTBOX-GUEST-MARKER"
ROOT_LABEL = "agentbox-root"

_APPLETS = (
    "sh", "mount", "insmod", "findfs", "mkdir", "chroot", "ip", "reboot", "sleep", "cat", "setpriv",
)  # fmt: skip
DATA_LABEL = wire_module.DATA_LABEL
#: The guest agent's source, shipped next to its wire.py (the host never imports it).
AGENT_SOURCE = Path(wire_module.__file__).with_name("agent.py")
#: The agent's sibling modules, shipped (and compiled) next to it.
AGENT_PARTS = tuple(AGENT_SOURCE.with_name(f"{n}.py") for n in
                    ("_agent_sys", "_agent_mounts", "_agent_streams"))  # fmt: skip
#: How /init starts the agent: the precompiled module from the read-only bind.
_AGENT_CMD = (
    "/usr/bin/python3 -I -S -c "
    "'import sys; sys.path.insert(0, \"/opt/agentbox/vm\"); import agent; agent.main()'"
)


def _init_script(modules: Sequence[str]) -> str:
    """``/init`` loading ``modules`` in order (:data:`INIT_SCRIPT` for the base list)."""
    return f"""#!/bin/sh
# agentbox microVM init (PID 1). Any failure reboots, which ends the VM (-no-reboot).
export PATH=/bin
fail() {{ echo "agentbox-init: $*" > /dev/console; reboot -f; }}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {" ".join(modules)}; do insmod /lib/modules/$m.ko || fail "insmod $m"; done
[ -n "$agentbox_probe" ] && {{ echo "{MARKER}" > /dev/console; reboot -f; }}
i=0
while ! root=$(findfs LABEL={ROOT_LABEL} 2>/dev/null); do
  i=$((i+1)); [ $i -gt 400 ] && fail "no root disk"; sleep 0.02
done
mount -t ext4 -o ro,noload,nodev "$root" /newroot || fail "mount root"
if [ -n "$agentbox_data" ]; then
  # A cold boot mounts /data here (a snapshot template must not: its disk is swapped).
  i=0
  while ! data=$(findfs LABEL={DATA_LABEL} 2>/dev/null); do
    i=$((i+1)); [ $i -gt 400 ] && fail "no data disk"; sleep 0.02
  done
  mount -t ext4 -o nosuid,nodev,commit=1 "$data" /newroot/workspace || fail "mount data"
fi
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/tmp
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/home/agent
mount --bind /agentbox /newroot/opt/agentbox/vm && mount -o remount,bind,ro /newroot/opt/agentbox/vm
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/dev/shm
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
ip link set lo up
if [ -n "$agentbox_marker" ]; then
  chroot /newroot /usr/bin/python3 -I -S -c 'print("{MARKER}")'
  reboot -f
fi
# no_new_privs from here on: nothing the agent starts can gain privileges by exec.
setpriv --nnp chroot /newroot {_AGENT_CMD}
fail "agent exited"
"""


INIT_SCRIPT = _init_script(MODULES)


def _entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> bytes:
    name_b = name.encode() + b"\0"
    fields = (0, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0)
    head = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
    out = head + name_b
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def build_cpio(files: dict[str, tuple[int, bytes]], dirs: list[str]) -> bytes:
    """An uncompressed ``newc`` archive: ``files`` maps path → (mode, content).

    Symlinks are given as mode ``0o120777`` with the target as content; owner
    root, mtime 0, so the archive is reproducible.
    """
    parts = [_entry(d, 0o040755) for d in dirs]
    parts.append(_entry("dev/console", 0o020600, rdev=(5, 1)))
    parts += [_entry(p, mode, data) for p, (mode, data) in sorted(files.items())]
    parts.append(_entry("TRAILER!!!", 0))
    blob = b"".join(parts)
    return blob + b"\0" * (-len(blob) % 512)


def _has_interp(elf: bytes) -> bool:
    """Whether an ELF64 binary asks for a dynamic loader (a PT_INTERP header)."""
    if not elf.startswith(b"\x7fELF") or len(elf) < 64:
        return True
    phoff = int.from_bytes(elf[0x20:0x28], "little")
    phentsize = int.from_bytes(elf[0x36:0x38], "little")
    phnum = int.from_bytes(elf[0x38:0x3A], "little")
    for i in range(phnum):
        off = phoff + i * phentsize
        if int.from_bytes(elf[off : off + 4], "little") == 3:  # PT_INTERP
            return True
    return False


def _agent_bytecode(source: bytes, name: str = "agent") -> tuple[str, bytes]:
    """The agent (or its ``wire``) compiled by this interpreter, as an unchecked-hash ``.pyc``.

    Compiling ``agent.py`` costs the guest tens of milliseconds of a cold boot
    under TCG. The file is named for this interpreter's cache tag, so a guest
    whose python differs ignores it and compiles the source (which it cannot
    write back: the bind is read-only); the magic number is checked either way.
    """
    with tempfile.TemporaryDirectory(prefix="agentbox-pyc-") as d:
        src = Path(d) / f"{name}.py"
        src.write_bytes(source)
        out = Path(d) / f"{name}.pyc"
        py_compile.compile(
            str(src), cfile=str(out), dfile=f"/opt/agentbox/vm/{name}.py", doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )  # fmt: skip
        return f"{name}.{sys.implementation.cache_tag}.pyc", out.read_bytes()


def ensure_initramfs(
    settings: Settings, kernel: Kernel, *, extra_modules: Sequence[Path] = ()
) -> Path:
    """The cached initramfs for ``kernel`` and the current agent (keyed by content).

    ``extra_modules`` (``.ko`` files, in load order) are added after the base
    modules and loaded by ``/init`` after them: the firecracker backend adds the
    vsock modules this way. Without them the archive is exactly the qemu one.
    """
    busybox = shutil.which("busybox")
    if busybox is None:
        raise ImageError("busybox not found (fix: apt-get install busybox-static)")
    # Every VM start asks; re-reading and hashing ~3 MB each time costs a cold boot
    # ~10 ms. Remembered per process while no input file changes (size, mtime).
    inputs = [Path(busybox), AGENT_SOURCE, Path(wire_module.__file__), *AGENT_PARTS]
    inputs += extra_modules
    inputs += [kernel.modules / f"{m}.ko" for m in MODULES]
    memo_key = (kernel.release, str(settings.cache_dir), *(_stamp(p) for p in inputs))
    hit = _MEMO.get(memo_key)
    if hit is not None and hit.is_file():
        return hit
    out = _build_initramfs(settings, kernel, Path(busybox), extra_modules)
    _MEMO[memo_key] = out
    return out


_MEMO: dict[tuple[object, ...], Path] = {}


def _stamp(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def _build_initramfs(
    settings: Settings, kernel: Kernel, busybox: Path, extra_modules: Sequence[Path]
) -> Path:
    bb = busybox.read_bytes()
    if _has_interp(bb):
        raise ImageError("busybox is dynamically linked (fix: apt-get install busybox-static)")
    agent = AGENT_SOURCE.read_bytes()
    wire = Path(wire_module.__file__).read_bytes()
    files: dict[str, tuple[int, bytes]] = {
        "init": (0o100755, _init_script([*MODULES, *(m.stem for m in extra_modules)]).encode()),
        "bin/busybox": (0o100755, bb),
        "agentbox/agent.py": (0o100644, agent),
        "agentbox/wire.py": (0o100644, wire),
        **{f"agentbox/{p.name}": (0o100644, p.read_bytes()) for p in AGENT_PARTS},
    }
    for applet in _APPLETS:
        files[f"bin/{applet}"] = (0o120777, b"busybox")
    for m in MODULES:
        files[f"lib/modules/{m}.ko"] = (0o100644, (kernel.modules / f"{m}.ko").read_bytes())
    for ko in extra_modules:
        files[f"lib/modules/{ko.name}"] = (0o100644, ko.read_bytes())
    dirs = ["agentbox", "agentbox/__pycache__", "bin", "dev", "lib", "lib/modules", "newroot"]
    dirs += ["proc", "sys"]
    # Keyed by the agent's source and this interpreter, not by the bytecode (which
    # need not be byte-for-byte reproducible).
    h = hashlib.sha256(f"{kernel.release}\0{sys.version}\0".encode())
    for p, (mode, data) in sorted(files.items()):
        h.update(f"{p}:{mode}:{len(data)}:".encode() + data)
    out_dir = settings.cache_dir / "microvm" / "initramfs"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{h.hexdigest()[:16]}.cpio"
    if out.is_file():
        return out  # tiny; pruned only when a new one is built
    with (out_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            pyc_name, pyc = _agent_bytecode(agent)
            files[f"agentbox/__pycache__/{pyc_name}"] = (0o100644, pyc)
            pyc_name, pyc = _agent_bytecode(wire, "wire")
            files[f"agentbox/__pycache__/{pyc_name}"] = (0o100644, pyc)
            for part in AGENT_PARTS:
                pyc_name, pyc = _agent_bytecode(part.read_bytes(), part.stem)
                files[f"agentbox/__pycache__/{pyc_name}"] = (0o100644, pyc)
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(build_cpio(files, dirs))
            tmp.chmod(0o644)
            tmp.replace(out)
            from agentbox.backends.microvm._disks import prune_cache

            prune_cache(out_dir, "*.cpio", 4, used=out)
    return out
