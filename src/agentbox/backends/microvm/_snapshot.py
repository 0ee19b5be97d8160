"""Snapshots: boot once per (image, kernel, initramfs, shape) to a ready agent, save, restore.

Saving: a template VM boots with a placeholder ``/data`` disk that its guest
never mounts, the host waits for the agent's ``ready``, disconnects, and QMP
``stop`` + ``getfd`` + ``migrate fd:`` writes the device and RAM state into a
file in the cache (QEMU 7.2 has no ``file:`` URI, and ``exec:`` would need the
``spawn`` that our seccomp filter denies). Restoring: the same command line
with a fresh ``/data`` disk bound at the same jail path, ``-S -incoming fd:N``
on the opened state file, wait for the load, ``cont``; only then does the host
write to the guest (hello: new token, clock, RNG reseed, mount ``/data``).

Declared read-only mounts take the snapshot path too: a restored VM must have
its template's device set, so there is one template per number of mounts
(part of the key), booted with that many placeholder mount disks of the fixed
:data:`~agentbox.backends.microvm._disks.MOUNT_DISK_BYTES` and the same labels. Its
guest never mounts them; after restore the agent drops what the template
cached of each (``BLKFLSBUF``) and checks the label again before mounting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._disks import (
    DATA_DISK_BYTES,
    MOUNT_DISK_BYTES,
    make_data_disk,
    make_mount_disk,
    prune_cache,
)
from agentbox.backends.microvm._guest import GuestSession, host_kernel
from agentbox.backends.microvm._qmp import wait_loaded, wait_migration
from agentbox.backends.microvm._vm import TCG_CPU, Vm, VmConfig
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError

log = get_logger(__name__)

BOOT_TIMEOUT = 180.0
#: Snapshots kept in the cache (one per recently used image and VM shape).
KEEP_SNAPSHOTS = 4


def snapshot_key(cfg: VmConfig, qemu_version: str) -> str:
    """What a snapshot depends on: kernel, initramfs, root disk, VM shape (with the
    number and size of read-only mount disks), accel, QEMU."""
    parts = [cfg.kernel.release, cfg.initramfs.name, cfg.root_disk.name, str(cfg.memory_mib),
             str(cfg.cpus), cfg.accel, TCG_CPU, qemu_version]  # fmt: skip
    if cfg.mount_disks:  # keys of mount-less snapshots stay what they were
        parts += [f"mounts={len(cfg.mount_disks)}x{MOUNT_DISK_BYTES}"]
    # The guest sized its /data device at boot: a template of another size cannot serve.
    parts += [f"data={DATA_DISK_BYTES}"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def ensure_snapshot(cache_dir: Path, cfg: VmConfig, qemu_version: str) -> Path:
    """The saved state for ``cfg``'s shape, made on first use (once per host, locked)."""
    d = cache_dir / "microvm" / "snapshots"
    d.mkdir(parents=True, exist_ok=True)
    out = d / f"{snapshot_key(cfg, qemu_version)}.state"
    if out.is_file():
        prune_cache(d, "*.state", KEEP_SNAPSHOTS, used=out)
        return out
    with (d / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        _save(cfg, out)
        prune_cache(d, "*.state", KEEP_SNAPSHOTS, used=out)
    return out


def _save(cfg: VmConfig, out: Path) -> None:
    work = out.parent / f".tmpl-{os.getpid()}-{time.monotonic_ns()}"
    work.mkdir(mode=0o700)
    tmpl = dataclasses.replace(
        cfg, name=f"tmpl-{work.name[6:]}"[:60], run_dir=work / "run",
        data_disk=make_data_disk(None, work / "data.img"), incoming_fd=None, marker=False,
        mount_disks=tuple(make_mount_disk(None, work / f"m{i}.img", index=i, uid=0)
                          for i in range(len(cfg.mount_disks))),
    )  # fmt: skip
    vm = Vm(tmpl)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        vm.start()
        sock = vm.connect(BOOT_TIMEOUT)
        chan = Channel(sock, name=tmpl.name)
        GuestSession(chan, name=tmpl.name, host=host_kernel()).wait_ready(BOOT_TIMEOUT)
        chan.close()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            vm.qmp(
                ("stop", None),
                ("migrate-set-parameters", {"max-bandwidth": 64 * 1024**3}),
                ("getfd", {"fdname": "snap", "fd": fd}),
                ("migrate", {"uri": "fd:snap"}),
                wait_migration(),
                timeout=300,
            )
        finally:
            os.close(fd)
        tmp.replace(out)
        log.info("snapshot saved", path=str(out), bytes=out.stat().st_size)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        vm.kill()
        shutil.rmtree(work, ignore_errors=True)


def wait_incoming(vm: Vm, timeout: float = 60.0) -> None:
    """Wait until a ``-incoming`` VM has loaded its state, then ``cont``."""
    end = time.monotonic() + timeout
    while not vm.qmp_socket.exists():  # QEMU makes it before it reads the state
        if not vm.alive():
            raise SandboxError(f"restore failed: {vm.log_tail()}", sandbox=vm.cfg.name)
        if time.monotonic() > end:
            raise SandboxError("QEMU's QMP socket never appeared", sandbox=vm.cfg.name)
        time.sleep(0.002)
    while True:
        try:
            status = vm.qmp(wait_loaded(), timeout=max(1.0, end - time.monotonic()))[0]
            break
        except SandboxError as exc:
            if not vm.alive():
                raise SandboxError(f"restore failed: {vm.log_tail()}", sandbox=vm.cfg.name) from exc
            if time.monotonic() > end:
                raise
            time.sleep(0.01)  # the socket exists a moment before QEMU listens on it
    if status != "running":
        vm.qmp(("cont", None), timeout=10)
