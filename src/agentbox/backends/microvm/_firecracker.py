"""One Firecracker microVM under its jailer: VM config, jailer argv, the jail's files.

Firecracker runs as::

    unshare --pid --fork --kill-child --mount-proc --net --ipc --uts --
      unshare --fork --kill-child --        (pid 1: the holder)
      jailer --id <vm> --exec-file <firecracker> --uid U --gid U
             --chroot-base-dir <vm dir>/jail --cgroup-version 1|2 --parent-cgroup agentbox
             --cgroup pids.max=128 --cgroup memory.limit_in_bytes=N (v2: memory.max, swap 0)
             --resource-limit no-file=… --resource-limit fsize=…
        -- --config-file /config.json --no-api

* ``unshare`` gives it empty network, ipc and uts namespaces and a pid
  namespace (rather than the jailer's own ``--new-pid-ns``, whose parent
  exits at once: here the VMM stays our descendant, so liveness, waiting and
  killing its process group work as for QEMU). Its pid 1 is a second
  ``unshare`` that only forks and waits: it keeps the parent-death signal
  (the jailer's uid switch clears the VMM's), so when agentbox dies, pid 1
  dies and the kernel kills the whole namespace, Firecracker included.
  ``--mount-proc`` gives it a ``/proc`` of that pid namespace, so the jailer's
  own ``/proc/<its pid>`` lookups see itself, not the host's pid 1. No ``ip
  netns`` handle is needed, so nothing persists after the VM.
* The jailer adds its own mount namespace (``pivot_root`` into the chroot),
  the pids and memory cgroups (the same ``agentbox/<vm>`` dirs the qemu
  backend's VMMs use, so ``kill_sandbox``/``recover_sandbox`` treat both
  alike), rlimits, and drops to uid ``U`` (never 0: as root the VMM would
  keep every capability, so the firecracker backend always uses the
  dedicated uid).
* Firecracker applies its own seccomp filters to every thread.
* The chroot holds exactly what :func:`place_files` puts there (kernel,
  initramfs, root disk read-only and root-owned; the ``/data`` disk, log and
  metrics files owned by ``U``; the config) plus what the jailer adds itself
  (its copy of the binary, ``/dev/kvm``, ``/dev/net/tun``, ``/dev/urandom``
  where its version makes them) and, at run time, the vsock socket.

Devices reach Debian's cloud kernel through ACPI (it has no virtio-mmio
command-line devices): Firecracker describes virtio-mmio devices in ACPI
tables on x86_64 since **v1.8.0** (:data:`MIN_VERSION`); older releases
cannot boot our guest.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.backends.microvm._disks import DATA_DISK_BYTES
from agentbox.backends.microvm._jail import VMM_PIDS_MAX
from agentbox.backends.microvm._kernel import Kernel
from agentbox.backends.microvm._vm import VMM_OVERHEAD, host_tsc_khz
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ImageError, UnsupportedError

log = get_logger(__name__)

#: First release that describes virtio-mmio devices to x86_64 guests via ACPI (#4428).
MIN_VERSION = (1, 8, 0)
#: Guest modules for virtio-vsock, in load order (after the base virtio modules).
VSOCK_MODULES = ("vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport")
#: The guest's vsock context id (2 is the host; 3 is the first guest id).
GUEST_CID = 3
#: The hybrid-vsock unix socket, as a path inside the jail.
VSOCK_UDS = "/v.sock"
#: Cgroup parent of every VMM (the qemu backend's Cgroup uses the same dirs).
PARENT_CGROUP = "agentbox"
#: Jail path → role, for everything :func:`place_files` puts in the chroot.
JAIL_FILES = {
    "vmlinux": "kernel (read-only, root-owned)",
    "initramfs": "initramfs (read-only, root-owned)",
    "root.img": "root disk (read-only, root-owned)",
    "data.img": "/data disk (the VMM uid's, 0600)",
    "config.json": "VM config (read-only, root-owned)",
    "firecracker.log": "Firecracker's own log (the VMM uid's)",
    "metrics.json": "Firecracker's metrics (the VMM uid's)",
}
_NOFILE = 1024
_VERSION = re.compile(r"\b(?:Firecracker|Jailer) v(\d{1,4})\.(\d{1,4})\.(\d{1,4})\b")


@dataclass(frozen=True)
class FcSpec:
    """One VM: its jailer id, host files, shape and identity."""

    id: str
    kernel: Path
    initramfs: Path
    root_disk: Path
    data_disk: Path | None
    vcpus: int
    memory_mib: int
    uid: int
    gid: int
    cmdline_extra: tuple[str, ...] = ()
    """Extra kernel arguments (the qemu backend's, e.g. ``agentbox_data=1`` for a cold boot)."""
    mount_disks: tuple[Path, ...] = ()
    """One read-only disk per declared mount (``m<i>.img`` in the jail), in spec order."""


# -- versions
def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(1, 10, 1)`` from ``firecracker --version`` / ``jailer --version`` output."""
    m = _VERSION.search(text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _fmt(v: tuple[int, int, int]) -> str:
    return "v" + ".".join(map(str, v))


def check_versions(firecracker_out: str, jailer_out: str) -> tuple[int, int, int]:
    """The Firecracker version, or UnsupportedError naming :data:`MIN_VERSION`."""
    fc, jl = parse_version(firecracker_out), parse_version(jailer_out)
    need = _fmt(MIN_VERSION)
    if fc is None:
        raise UnsupportedError(
            f"cannot read a version from `firecracker --version`: {firecracker_out[:200]!r}",
            fix=f"install Firecracker {need} or later",
        )
    if fc < MIN_VERSION:
        raise UnsupportedError(
            f"Firecracker {_fmt(fc)} is too old: {need} or later describes virtio-mmio devices "
            "to x86_64 guests via ACPI, which Debian's cloud kernel needs",
            fix=f"install Firecracker {need} or later",
        )
    if jl != fc:
        seen = _fmt(jl) if jl else repr(jailer_out[:100])
        raise UnsupportedError(
            f"jailer {seen} does not match Firecracker {_fmt(fc)}",
            fix="install the jailer from the same Firecracker release",
        )
    return fc


@functools.cache
def _version_output(binary: str, mtime_ns: int) -> str:
    del mtime_ns  # part of the cache key only: a replaced binary is asked again
    try:
        res = _proc.run([binary, "--version"], timeout=30, check=False)
    except AgentboxError as exc:
        return f"error: {exc}"
    return res.stdout + res.stderr


def version_output(binary: Path) -> str:
    """``binary --version`` (cached per binary and mtime)."""
    try:
        mtime = binary.stat().st_mtime_ns
    except OSError as exc:
        return f"error: {exc}"
    return _version_output(str(binary), mtime)


# -- guest side
def ensure_vsock_modules(settings: Settings, kernel: Kernel) -> list[Path]:
    """The vsock ``.ko`` files of ``kernel`` (fetched from its package on first use).

    The kernel cache made by :func:`~agentbox.backends.microvm._kernel.ensure_kernel`
    keeps only the modules the qemu backend needs; these come from the same
    Debian package (``linux-image-<release>``) and are added next to them.
    """
    want = [kernel.modules / f"{m}.ko" for m in VSOCK_MODULES]
    if all(p.is_file() for p in want):
        return want
    root = kernel.vmlinux.parent.parent
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(p.is_file() for p in want):
            return want
        package = f"linux-image-{kernel.release}"
        log.info("fetching vsock modules", package=package)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            t = Path(tmp)
            _proc.run(["apt-get", "download", package], cwd=t, timeout=600)
            debs = list(t.glob("*.deb"))
            if len(debs) != 1:
                raise ImageError(f"apt-get download {package} left {len(debs)} .deb files")
            _proc.run(["dpkg-deb", "-x", debs[0], t / "x"], timeout=300)
            found = {ko.stem: ko for ko in (t / "x/lib/modules").rglob("*.ko")}
            for m, dest in zip(VSOCK_MODULES, want, strict=True):
                if m not in found:
                    raise ImageError(f"{package} has no {m}.ko (fix: a kernel with vsock)")
                tmp_dest = dest.with_suffix(".ko.tmp")
                shutil.copyfile(found[m], tmp_dest)
                tmp_dest.replace(dest)
    return want


def boot_args(extra: Sequence[str] = ()) -> str:
    """The kernel command line: qemu's flags, Firecracker's reboot, the vsock switch.

    ``reboot=k``: Firecracker exits when the guest resets through the keyboard
    controller (the guest's ``reboot -f`` and ``panic=-1`` both end the VM).
    ``pci=off``: no PCI bus to probe. ``agentbox_transport=vsock`` makes the
    agent listen on AF_VSOCK (see :mod:`agentbox.guest.agent`).
    """
    return " ".join([
        "console=ttyS0", "quiet", "loglevel=1", "panic=-1", "reboot=k", "pci=off",
        "i8042.noaux", "i8042.nomux", "i8042.nopnp", "i8042.dumbkbd",
        f"tsc_early_khz={host_tsc_khz()}", "tsc=reliable", "random.trust_cpu=on",
        "init=/init", "agentbox_transport=vsock", *extra,
    ])  # fmt: skip


def vcpu_count(cpus: int) -> int:
    """Firecracker takes 1 or an even number of vCPUs (at most 32)."""
    n = max(1, min(cpus, 32))
    return n if n == 1 or n % 2 == 0 else n - 1


def vm_config(spec: FcSpec) -> dict[str, Any]:
    """The ``--config-file`` JSON (paths are the jail's). No network interface."""
    drives: list[dict[str, Any]] = [
        {"drive_id": "root", "path_on_host": "/root.img", "is_root_device": False,
         "is_read_only": True, "cache_type": "Unsafe"},
    ]  # fmt: skip
    if spec.data_disk is not None:
        # Writeback: the guest's flushes reach the file, so what `sync` wrote is
        # there when the host reads the disk of a VM that was killed.
        drives.append({"drive_id": "data", "path_on_host": "/data.img", "is_root_device": False,
                       "is_read_only": False, "cache_type": "Writeback"})  # fmt: skip
    for i in range(len(spec.mount_disks)):
        drives.append({"drive_id": f"m{i}", "path_on_host": f"/m{i}.img", "is_root_device": False,
                       "is_read_only": True, "cache_type": "Unsafe"})  # fmt: skip
    return {
        "boot-source": {
            "kernel_image_path": "/vmlinux",
            "initrd_path": "/initramfs",
            "boot_args": boot_args(spec.cmdline_extra),
        },
        "drives": drives,
        "machine-config": {
            "vcpu_count": vcpu_count(spec.vcpus),
            "mem_size_mib": max(128, spec.memory_mib),
            "smt": False,
        },
        "vsock": {"guest_cid": GUEST_CID, "uds_path": VSOCK_UDS},
        "network-interfaces": [],
        "logger": {"log_path": "/firecracker.log", "level": "Warning", "show_level": True},
        "metrics": {"metrics_path": "/metrics.json"},
    }


# -- host side
def cgroup_version() -> int:
    """2 on a unified hierarchy, else 1 (v1 and hybrid hosts)."""
    return 2 if _host.cgroup_mode() == "v2" else 1


def cgroup_dirs(vm_id: str, version: int | None = None) -> list[Path]:
    """The cgroup dirs the jailer makes for ``vm_id`` under :data:`PARENT_CGROUP`."""
    root = Path("/sys/fs/cgroup")
    if (version or cgroup_version()) == 2:
        return [root / PARENT_CGROUP / vm_id]
    return [root / "pids" / PARENT_CGROUP / vm_id, root / "memory" / PARENT_CGROUP / vm_id]


def chroot_dir(base: Path, firecracker: Path, vm_id: str) -> Path:
    """Where the jailer roots the VMM: ``<base>/<exec file name>/<id>/root``."""
    return base / firecracker.name / vm_id / "root"


#: pid 1 between the outer ``unshare`` and the jailer (see :func:`jailer_argv`).
HOLDER = ("unshare", "--fork", "--kill-child", "--")


def jailer_argv(
    jailer: Path,
    firecracker: Path,
    spec: FcSpec,
    *,
    chroot_base: Path,
    cgroup_v: int | None = None,
) -> list[str]:
    """The full argv: ``unshare`` (pid, net, ipc, uts) → jailer → Firecracker's own flags."""
    v = cgroup_v or cgroup_version()
    mem = max(128, spec.memory_mib) * 1024**2 + VMM_OVERHEAD
    if v == 2:
        limits = [f"pids.max={VMM_PIDS_MAX}", f"memory.max={mem}", "memory.swap.max=0"]
    else:
        limits = [f"pids.max={VMM_PIDS_MAX}", f"memory.limit_in_bytes={mem}"]
    argv = [
        "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--uts",
        "--",
        # pid 1 of the namespace: a holder that never changes credentials, so the
        # parent-death signal the outer unshare gave it survives (the jailer's uid
        # switch clears its own). If we die, it dies, and with pid 1 the kernel
        # kills everything in the namespace: no Firecracker outlives agentbox.
        *HOLDER,
        str(jailer), "--id", spec.id, "--exec-file", str(firecracker),
        "--uid", str(spec.uid), "--gid", str(spec.gid),
        "--chroot-base-dir", str(chroot_base),
        "--cgroup-version", str(v), "--parent-cgroup", PARENT_CGROUP,
    ]  # fmt: skip
    for limit in limits:
        argv += ["--cgroup", limit]
    # fsize bounds every file the VMM can grow: the /data disk's fixed size, plus its logs.
    argv += ["--resource-limit", f"no-file={_NOFILE}",
             "--resource-limit", f"fsize={DATA_DISK_BYTES + 64 * 1024**2}"]  # fmt: skip
    return [*argv, "--", "--config-file", "/config.json", "--no-api"]


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        # Another filesystem: copy (slower for the root disk, but never shared writable).
        shutil.copyfile(src, dest)


def place_files(chroot: Path, spec: FcSpec) -> dict[str, Path]:
    """Put exactly the VM's declared files into ``chroot``; return jail name → host file.

    Shared read-only files (kernel, initramfs, root disk) are hard links (or
    copies) left root-owned and never re-owned, so the VMM can read them but
    not change the cached originals every VM shares; declared mounts' disks
    (``m<i>.img``) are root-owned and read-only too; the ``/data`` disk and the
    log and metrics files belong to the VMM's uid. Nothing else is added.
    """
    if chroot.exists():
        raise AgentboxError(f"jail {chroot} already exists")
    chroot.mkdir(parents=True, mode=0o700)
    placed: dict[str, Path] = {}
    shared = {"vmlinux": spec.kernel, "initramfs": spec.initramfs, "root.img": spec.root_disk}
    for name, src in shared.items():
        st = src.stat()
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise AgentboxError(f"{src} must be root-owned and not group/world-writable")
        _link_or_copy(src, chroot / name)
        placed[name] = src
    for i, disk in enumerate(spec.mount_disks):
        # This sandbox's own copy of a declared mount: root-owned and read-only, so
        # the VMM (opening it read-only) can neither write it nor chmod it writable.
        name = f"m{i}.img"
        _link_or_copy(disk, chroot / name)
        os.chown(chroot / name, 0, 0)
        (chroot / name).chmod(0o444)
        placed[name] = disk
    if spec.data_disk is not None:
        _link_or_copy(spec.data_disk, chroot / "data.img")
        os.chown(chroot / "data.img", spec.uid, spec.gid)
        (chroot / "data.img").chmod(0o600)
        placed["data.img"] = spec.data_disk
    cfg = chroot / "config.json"
    cfg.write_text(json.dumps(vm_config(spec), indent=1))
    cfg.chmod(0o444)
    placed["config.json"] = cfg
    for name in ("firecracker.log", "metrics.json"):
        p = chroot / name
        p.touch(mode=0o600)
        os.chown(p, spec.uid, spec.gid)
        placed[name] = p
    return placed


def jail_entries(chroot: Path) -> Mapping[str, str]:
    """What is in a jail now (name → file type), for checks and diagnostics."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for p in sorted(chroot.rglob("*")):
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
            if p.is_char_device():
                kind = "chardev"
            elif p.is_socket():
                kind = "socket"
            out[str(p.relative_to(chroot))] = kind
    return out
