"""The ``host.snapshot_ram_private`` probe: a restored microVM's writes stay its own.

Every VM restored from one snapshot maps the same RAM (the snapshot's sealed
memfd) and reads each page it has not written from there. So a page one guest
writes must never reach that shared object, or the next VM (or every VM that has
not written that page yet) would read it. The probe has the workload of one
restored VM fill guest memory with a random marker, then reads, from the host,
the object its RAM is mapped from: the probe passes when the marker is nowhere
in it and its content is what it was before.

Its control, :class:`SharedRamControl`, restores a VM the naive way: its RAM
mapped *shared* from a writable copy of the snapshot's RAM, so the guest's
writes land in that file: the probe must fire there.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from agentbox.backends.microvm import Vm
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
from agentbox.escape._model import Outcome, ProbeSpec

SPEC = ProbeSpec(
    "host.snapshot_ram_private",
    "host",
    "the workload of one restored microVM fills 32 MiB of guest memory with a marker; "
    "read the RAM every VM restored from that snapshot maps",
    "marker absent, that RAM unchanged",
    "shared-ram",
    "vm",
    "security review",
)
_FILL = 32 * 1024**2
_CHUNK = 1 << 20
PAGE = 4096


def _scan(source: int | Path, marker: bytes) -> tuple[str, bool]:
    """(digest of the non-zero pages, whether ``marker`` occurs) of an fd or a file."""
    fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h = hashlib.sha256()
        found, tail, pos = False, b"", 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break  # only a hole is left
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for off in range(start, end, _CHUNK):
                chunk = os.pread(fd, min(_CHUNK, end - off), off)
                found = found or marker in tail + chunk
                tail = chunk[-len(marker) :]
                # A page a guest first touched reads as zero in the memfd: as a hole does.
                for i in range(0, len(chunk), PAGE):
                    page = chunk[i : i + PAGE]
                    if page.count(0) != len(page):
                        h.update((off + i).to_bytes(8, "little") + page)
            pos = end
        return h.hexdigest(), found
    finally:
        if not isinstance(source, int):
            os.close(fd)


def shared_ram(sb: QemuSandbox) -> int | Path:
    """What ``sb``'s guest RAM is mapped from: the snapshot's memfd, or a file."""
    cfg = sb.vm.cfg
    if cfg.ram_fd is not None:
        return cfg.ram_fd
    if cfg.ram_file is not None:
        return cfg.ram_file
    raise ValueError(f"{sb.name} was not restored from a snapshot")


def snapshot_ram_outcome(sb: QemuSandbox) -> Outcome:
    """Run the probe on the restored VM ``sb`` (see the module docstring)."""
    source = shared_ram(sb)
    marker = b"agentbox-ram-" + secrets.token_hex(16).encode()
    before, seen = _scan(source, marker)
    script = (
        "import sys; m = sys.argv[1].encode(); "
        f"open('/dev/shm/ram-probe', 'wb').write(m * ({_FILL} // len(m)))"
    )
    res = sb.exec(["python3", "-c", script, marker.decode()], timeout=120)
    if res.exit_code != 0 or seen:
        why = "marker there before the write" if seen else res.stderr.decode()[-300:]
        return _outcome(f"could not run: {why}", "error")
    after, found = _scan(source, marker)
    if found:
        return _outcome("the guest's marker is in the RAM other VMs map", "fail")
    if after != before:
        return _outcome("the RAM other VMs map changed while the guest wrote", "fail")
    return _outcome("marker absent; the shared RAM unchanged", "pass")


def _outcome(seen: str, status: str) -> Outcome:
    return Outcome(SPEC.id, SPEC.where, SPEC.tried, SPEC.expected, seen, status)  # type: ignore[arg-type]


class SharedRamControl(QemuBackend):
    """The control: each restore maps a writable copy of the snapshot's RAM *shared*."""

    def _start(self, vm: Vm) -> None:
        start = vm.start

        def weakened(*, stdout_fd: int | None = None) -> None:
            assert vm.cfg.ram_fd is not None
            copy = vm.cfg.run_dir.parent / "shared-ram.img"
            _copy(vm.cfg.ram_fd, copy)
            os.chown(copy, vm.cfg.uid, vm.cfg.gid)
            vm.cfg.ram_file, vm.cfg.ram_fd = copy, None
            start(stdout_fd=stdout_fd)

        vm.start = weakened  # type: ignore[method-assign]
        super()._start(vm)


def _copy(fd: int, dest: Path) -> None:
    """A sparse copy of the memfd ``fd``'s data into the new file ``dest``."""
    size = os.fstat(fd).st_size
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(out, size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for off in range(start, end, _CHUNK):
                os.pwrite(out, os.pread(fd, min(_CHUNK, end - off), off), off)
            pos = end
    finally:
        os.close(out)
