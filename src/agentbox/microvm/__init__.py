"""MicroVM parts shared by the qemu and firecracker backends.

Kernel (Debian's cloud kernel, unpacked to a PVH vmlinux), initramfs (busybox,
virtio modules, ``/init``, the guest agent), disks (``mkfs.ext4 -d``), the
VMM's jail, the framed agent channel, snapshots, posture, and the KVM probe.

This facade is the package's whole surface for other packages: the microVM
backends (``agentbox.backends.qemu``, ``.firecracker``, ``._microvm``) import
what they use from here, never a ``_private`` module (tests/unit/test_layering.py).
"""

from agentbox.microvm._channel import Channel
from agentbox.microvm._diskexport import export_disk
from agentbox.microvm._disks import (
    DATA_DISK_BYTES,
    MAX_MOUNTS,
    cached_mount_disk,
    ensure_root_disk,
    make_data_disk,
    make_mount_disk,
    mount_label,
)
from agentbox.microvm._export import write_tar
from agentbox.microvm._firecracker import (
    VSOCK_UDS,
    FcSpec,
    cgroup_dirs,
    check_versions,
    chroot_dir,
    ensure_vsock_modules,
    jail_entries,
    jailer_argv,
    place_files,
    version_output,
)
from agentbox.microvm._guest import GuestSession, host_kernel
from agentbox.microvm._initramfs import MARKER, ensure_initramfs
from agentbox.microvm._jail import Cgroup, spawn
from agentbox.microvm._kernel import (
    OVERLAY_MODULES,
    Kernel,
    decompress_bzimage,
    ensure_kernel,
    ensure_modules,
)
from agentbox.microvm._snapshot import ensure_snapshot, wait_incoming
from agentbox.microvm._vm import SANDBOX_FLAGS, Vm, VmConfig, qemu_argv
from agentbox.microvm._vsock import connect_vsock
from agentbox.microvm.kvm import boot_to_marker, probe_kvm

__all__ = [
    "DATA_DISK_BYTES",
    "MARKER",
    "MAX_MOUNTS",
    "OVERLAY_MODULES",
    "SANDBOX_FLAGS",
    "VSOCK_UDS",
    "Cgroup",
    "Channel",
    "FcSpec",
    "GuestSession",
    "Kernel",
    "Vm",
    "VmConfig",
    "boot_to_marker",
    "cached_mount_disk",
    "cgroup_dirs",
    "check_versions",
    "chroot_dir",
    "connect_vsock",
    "decompress_bzimage",
    "ensure_initramfs",
    "ensure_kernel",
    "ensure_modules",
    "ensure_root_disk",
    "ensure_snapshot",
    "ensure_vsock_modules",
    "export_disk",
    "host_kernel",
    "jail_entries",
    "jailer_argv",
    "make_data_disk",
    "make_mount_disk",
    "mount_label",
    "place_files",
    "probe_kvm",
    "qemu_argv",
    "spawn",
    "version_output",
    "wait_incoming",
    "write_tar",
]
