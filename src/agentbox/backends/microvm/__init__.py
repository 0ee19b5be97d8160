"""The microVM backends' family: ``qemu/`` and ``firecracker/`` below, and beside them
the machinery both are built from.

Kernel (Debian's cloud kernel, unpacked to a PVH vmlinux), initramfs (busybox,
virtio modules, ``/init``, the guest agent), disks (``mkfs.ext4 -d``), the
VMM's jail, the framed agent channel, snapshots, posture, and the KVM probe
(:mod:`.kvm`); the base class both backends subclass (:mod:`._base`) and VM
dirs, owner records and crash recovery (:mod:`._recover`).

This facade names the machinery for code outside the backends package.
"""

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._diskexport import export_disk
from agentbox.backends.microvm._disks import (
    DATA_DISK_BYTES,
    MAX_MOUNTS,
    cached_mount_disk,
    ensure_root_disk,
    make_data_disk,
    make_mount_disk,
    mount_label,
)
from agentbox.backends.microvm._export import write_tar
from agentbox.backends.microvm._firecracker import (
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
from agentbox.backends.microvm._fork import FROZEN_PREFIX, remove_stale_frozen
from agentbox.backends.microvm._guest import GuestSession, host_kernel
from agentbox.backends.microvm._initramfs import MARKER, ensure_initramfs
from agentbox.backends.microvm._jail import Cgroup, spawn
from agentbox.backends.microvm._kernel import (
    OVERLAY_MODULES,
    Kernel,
    decompress_bzimage,
    ensure_kernel,
    ensure_modules,
)
from agentbox.backends.microvm._snapram import snapshot_ram
from agentbox.backends.microvm._snapshot import Snapshot, ensure_snapshot, wait_incoming
from agentbox.backends.microvm._vm import SANDBOX_FLAGS, Vm, VmConfig, qemu_argv
from agentbox.backends.microvm._vsock import connect_vsock
from agentbox.backends.microvm.kvm import boot_to_marker, probe_kvm

__all__ = [
    "DATA_DISK_BYTES",
    "FROZEN_PREFIX",
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
    "Snapshot",
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
    "remove_stale_frozen",
    "snapshot_ram",
    "spawn",
    "version_output",
    "wait_incoming",
    "write_tar",
]
