"""A filesystem image mounted through a loop device, as ``mount -o loop`` does it.

``mount -t ext4 -o loop,OPTS IMAGE DIR`` is a process (util-linux's ``mount``: libmount
reads the whole mount table, probes, canonicalises) of ~10-20 ms on a host with a few
hundred mounts, on the path of every podman task's start (its workspace disk). What it
does to the kernel is: take a free loop device (``LOOP_CTL_GET_FREE``), attach the image
read-write with ``LO_FLAGS_AUTOCLEAR`` (the device detaches itself once the filesystem
is unmounted and no descriptor holds it), and ``mount(2)`` the device with the flags.
:func:`loop_mount` makes those calls (``LOOP_CONFIGURE``, Linux 5.8+); the resulting
mount and device are the same (``tests/integration/test_loop_mount.py`` compares them).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from pathlib import Path

from agentbox.linux.mounts import mount

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
#: Tries when another process takes the free device between our two calls.
_TRIES = 16


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


def loop_mount(image: Path, target: Path, fstype: str, flags: int) -> str:
    """Mount ``image`` (read-write) on ``target`` as ``fstype`` with ``flags`` (``MS_*``)
    through a free loop device that detaches itself at the unmount; the device's path.
    OSError if any step fails (nothing is left attached or mounted then)."""
    img = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        dev, lo = _attach(img, os.fsencode(image))
        try:
            mount(dev, target, flags, fstype)
        finally:
            os.close(lo)  # autoclear: with no mount left, this detaches it
    finally:
        os.close(img)
    return dev


def _attach(img: int, name: bytes) -> tuple[str, int]:
    """A free loop device attached to ``img`` with autoclear: its path and a descriptor."""
    cfg = _LoopConfig(fd=img)
    cfg.info.lo_flags = _LO_FLAGS_AUTOCLEAR
    name = name[:63]
    ctypes.memmove(cfg.info.lo_file_name, name, len(name))
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_TRIES):
            dev = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
            lo = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(lo, _LOOP_CONFIGURE, bytes(cfg))
            except OSError as exc:
                os.close(lo)
                if exc.errno == errno.EBUSY:  # taken meanwhile by another process
                    continue
                raise
            return dev, lo
    finally:
        os.close(ctl)
    raise OSError(errno.EBUSY, f"no free loop device after {_TRIES} tries")
