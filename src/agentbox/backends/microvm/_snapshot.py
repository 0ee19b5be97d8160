"""Snapshots: boot once per (image, kernel, initramfs, shape) to a ready agent, save, restore.

Saving: a template VM boots with a placeholder ``/data`` disk that its guest
never mounts and its RAM mapped shared from a file, the host waits for the
agent's ``ready``, disconnects, and QMP ``stop`` + ``getfd`` + ``migrate fd:``
writes the device state into ``<key>.state`` in the cache (QEMU 7.2 has no
``file:`` URI, and ``exec:`` would need the ``spawn`` that our seccomp filter
denies); with ``x-ignore-shared`` the RAM stays out of the stream, and the RAM
file, its zero pages dropped, becomes ``<key>.ram``. Restoring: the same command
line with a fresh ``/data`` disk bound at the same jail path, the RAM mapped
private from that file's sealed memfd (:mod:`._snapram`: shared by every VM
restored from it, copy-on-write), ``-S -incoming fd:N`` on the opened state
file, wait for the load, ``cont``; only then does the host write to the guest
(hello: new token, clock, RNG reseed, mount ``/data``).

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
from typing import Any

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
from agentbox.backends.microvm._snapram import save_ram
from agentbox.backends.microvm._vm import TCG_CPU, Vm, VmConfig
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError

log = get_logger(__name__)

BOOT_TIMEOUT = 180.0
#: Migration leaves out RAM mapped shared from a file (the template's ``<key>.ram``).
IGNORE_SHARED = {"capability": "x-ignore-shared", "state": True}
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
    parts += ["ram=mapped"]  # the state holds no RAM: <key>.ram does
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A saved template: its device state (a migration stream) and its RAM (sparse file)."""

    state: Path
    ram: Path


def find_snapshot(cache_dir: Path, cfg: VmConfig, qemu_version: str) -> Snapshot | None:
    """The saved template for ``cfg``'s shape if it is made, else None (never makes one)."""
    d = cache_dir / "microvm" / "snapshots"
    key = snapshot_key(cfg, qemu_version)
    snap = Snapshot(d / f"{key}.state", d / f"{key}.ram")
    return snap if snap.state.is_file() and snap.ram.is_file() else None


def ensure_snapshot(cache_dir: Path, cfg: VmConfig, qemu_version: str) -> Snapshot:
    """The saved template for ``cfg``'s shape, made on first use (once per host, locked)."""
    d = cache_dir / "microvm" / "snapshots"
    d.mkdir(parents=True, exist_ok=True)
    key = snapshot_key(cfg, qemu_version)
    snap = Snapshot(d / f"{key}.state", d / f"{key}.ram")
    if snap.state.is_file() and snap.ram.is_file():
        _prune(d, snap)
        return snap
    with (d / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if snap.state.is_file() and snap.ram.is_file():
            return snap
        _save(cfg, snap)
        _prune(d, snap)
    return snap


def _prune(d: Path, snap: Snapshot) -> None:
    # Only the state's mtime marks use: the RAM file's names its content (see snapshot_ram).
    prune_cache(d, "*.state", KEEP_SNAPSHOTS, used=snap.state)
    for ram in d.glob("*.ram"):
        if not ram.with_suffix(".state").exists():
            with contextlib.suppress(OSError):
                ram.unlink()


def _save(cfg: VmConfig, snap: Snapshot) -> None:
    work = snap.state.parent / f".tmpl-{os.getpid()}-{time.monotonic_ns()}"
    work.mkdir(mode=0o700)
    ram = work / "ram.img"
    ram.touch(mode=0o600)
    os.chown(ram, cfg.uid, cfg.gid)
    tmpl = dataclasses.replace(
        cfg, name=f"tmpl-{work.name[6:]}"[:60], run_dir=work / "run",
        data_disk=make_data_disk(None, work / "data.img"), incoming_fd=None, marker=False,
        mount_disks=tuple(make_mount_disk(None, work / f"m{i}.img", index=i, uid=0)
                          for i in range(len(cfg.mount_disks))),
        ram_file=ram, ram_fd=None,
    )  # fmt: skip
    vm = Vm(tmpl)
    tmp_state, tmp_ram = (
        p.with_name(f".{p.name}.tmp{os.getpid()}") for p in (snap.state, snap.ram)
    )
    try:
        vm.start()
        sock = vm.connect(BOOT_TIMEOUT)
        chan = Channel(sock, name=tmpl.name)
        GuestSession(chan, name=tmpl.name, host=host_kernel()).wait_ready(BOOT_TIMEOUT)
        chan.close()
        fd = os.open(tmp_state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            vm.qmp(
                ("stop", None),
                ("migrate-set-capabilities", {"capabilities": [IGNORE_SHARED]}),
                ("migrate-set-parameters", {"max-bandwidth": 64 * 1024**3}),
                ("getfd", {"fdname": "snap", "fd": fd}),
                ("migrate", {"uri": "fd:snap"}),
                wait_migration(),
                timeout=300,
            )
            os.fsync(fd)
        finally:
            os.close(fd)
        vm.terminate()  # stopped: the RAM file is what the state was saved with
        data = save_ram(ram, tmp_ram)
        tmp_ram.replace(snap.ram)
        tmp_state.replace(snap.state)
        log.info("snapshot saved", path=str(snap.state), state_bytes=snap.state.stat().st_size,
                 ram_bytes=data)  # fmt: skip
    except BaseException:
        for tmp in (tmp_state, tmp_ram):
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    finally:
        vm.kill()
        shutil.rmtree(work, ignore_errors=True)


def wait_incoming(vm: Vm, timeout: float = 60.0, *, ignore_shared: bool = True) -> None:
    """Wait until a ``-incoming`` VM has loaded its state, then ``cont``. ``ignore_shared``
    False: the stream carries the RAM (a fork's, see :mod:`._fork`)."""
    end = time.monotonic() + timeout
    while not vm.qmp_socket.exists():  # QEMU makes it before it reads the state
        if not vm.alive():
            raise SandboxError(f"restore failed: {vm.log_tail()}", sandbox=vm.cfg.name)
        if time.monotonic() > end:
            raise SandboxError("QEMU's QMP socket never appeared", sandbox=vm.cfg.name)
        time.sleep(0.002)
    load: list[tuple[str, dict[str, Any] | None]] = [wait_loaded()]
    mapped = vm.cfg.ram_fd is not None or vm.cfg.ram_file is not None
    if mapped and vm.cfg.incoming_fd is not None:  # -incoming defer
        caps = {"capabilities": [{**IGNORE_SHARED, "state": ignore_shared}]}
        load[:0] = [
            ("migrate-set-capabilities", caps),
            ("migrate-incoming", {"uri": f"fd:{vm.cfg.incoming_fd}"}),
        ]
    while True:  # the socket exists a moment before QEMU listens on it
        try:
            vm.qmp(("query-status", None), timeout=max(1.0, end - time.monotonic()))
            break
        except SandboxError as exc:
            if not vm.alive():
                raise SandboxError(f"restore failed: {vm.log_tail()}", sandbox=vm.cfg.name) from exc
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
    try:
        status = vm.qmp(*load, timeout=max(1.0, end - time.monotonic()))[-1]
    except SandboxError as exc:
        if not vm.alive():
            raise SandboxError(f"restore failed: {vm.log_tail()}", sandbox=vm.cfg.name) from exc
        raise
    if status != "running":
        vm.qmp(("cont", None), timeout=10)
