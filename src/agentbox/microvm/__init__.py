"""MicroVM parts shared by the qemu and firecracker backends.

Kernel (Debian's cloud kernel, unpacked to a PVH vmlinux), initramfs (busybox,
virtio modules, ``/init``, the guest agent), disks (``mkfs.ext4 -d``), the
VMM's jail, the framed agent channel, snapshots, posture, and the KVM probe.
"""

from agentbox.microvm._disks import DATA_DISK_BYTES, ensure_root_disk, make_data_disk
from agentbox.microvm._initramfs import MARKER, ensure_initramfs
from agentbox.microvm._kernel import Kernel, decompress_bzimage, ensure_kernel
from agentbox.microvm._vm import SANDBOX_FLAGS, Vm, VmConfig, qemu_argv
from agentbox.microvm.kvm import boot_to_marker, probe_kvm

__all__ = [
    "DATA_DISK_BYTES",
    "MARKER",
    "SANDBOX_FLAGS",
    "Kernel",
    "Vm",
    "VmConfig",
    "boot_to_marker",
    "decompress_bzimage",
    "ensure_initramfs",
    "ensure_kernel",
    "ensure_root_disk",
    "make_data_disk",
    "probe_kvm",
    "qemu_argv",
]
