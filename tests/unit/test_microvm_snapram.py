"""A snapshot's RAM: the sparse saved file and the sealed memfd restored VMs map.

The memfd is what every VM restored from one snapshot reads its untouched pages
from, so nothing may write it: not ``write``, not a shared writable mapping,
not a resize. A private mapping (what QEMU makes with ``share=off``) is allowed
and its writes stay in the mapping.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import pytest

from agentbox.backends.microvm._snapram import (
    PAGE,
    SEALS,
    adopt_ram,
    check_sealed,
    forget_ram,
    ram_ref,
    save_ram,
    snapshot_ram,
)
from agentbox.errors import SandboxError

SIZE = 64 * PAGE


@pytest.fixture(autouse=True)
def _fresh() -> object:
    forget_ram()
    yield
    forget_ram()


def _template_ram(path: Path) -> dict[int, bytes]:
    """A RAM file with a few written pages, one of them written with zeros."""
    pages = {0: b"A" * PAGE, 5: b"B" * 100 + bytes(PAGE - 100), 40: b"C" * PAGE}
    with path.open("wb") as f:
        f.truncate(SIZE)
        for i, data in pages.items():
            f.seek(i * PAGE)
            f.write(data)
        f.seek(20 * PAGE)
        f.write(bytes(PAGE))  # written, but zero: becomes a hole
    return pages


def test_saved_ram_keeps_the_data_and_drops_zero_pages(tmp_path: Path) -> None:
    pages = _template_ram(tmp_path / "tmpl")
    written = save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    assert written == 3 * PAGE
    data = (tmp_path / "snap.ram").read_bytes()
    assert len(data) == SIZE
    for i in range(SIZE // PAGE):
        assert data[i * PAGE : (i + 1) * PAGE] == pages.get(i, bytes(PAGE))
    assert (tmp_path / "snap.ram").stat().st_blocks * 512 < 8 * PAGE  # sparse


def test_the_memfd_is_sealed_and_shared_by_every_restore(tmp_path: Path) -> None:
    _template_ram(tmp_path / "tmpl")
    save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    fd = snapshot_ram(tmp_path / "snap.ram", SIZE)
    assert snapshot_ram(tmp_path / "snap.ram", SIZE) == fd  # one memfd per snapshot
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    assert os.pread(fd, PAGE, 40 * PAGE) == b"C" * PAGE
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, SIZE * 2)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # reopened as QEMU does (/proc/self/fd/N, read-write): the seals are the inode's
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"x", 0)
        private = mmap.mmap(reopened, SIZE, flags=mmap.MAP_PRIVATE)
        private[0:5] = b"guest"
        assert private[0:5] == b"guest"
        private.close()
    finally:
        os.close(reopened)
    assert os.pread(fd, 5, 0) == b"AAAAA"


def test_a_resaved_snapshot_gets_a_new_memfd(tmp_path: Path) -> None:
    _template_ram(tmp_path / "tmpl")
    save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    old = snapshot_ram(tmp_path / "snap.ram", SIZE)
    assert os.pread(old, 1, 0) == b"A"
    with (tmp_path / "tmpl").open("r+b") as f:
        f.write(b"Z" * PAGE)
    save_ram(tmp_path / "tmpl", tmp_path / "new.ram")
    (tmp_path / "new.ram").replace(tmp_path / "snap.ram")  # a new file (inode)
    assert os.pread(snapshot_ram(tmp_path / "snap.ram", SIZE), 1, 0) == b"Z"


def test_a_wrong_size_or_an_unsealed_fd_is_refused(tmp_path: Path) -> None:
    _template_ram(tmp_path / "tmpl")
    save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    with pytest.raises(SandboxError):
        snapshot_ram(tmp_path / "snap.ram", SIZE * 2)
    plain = os.memfd_create("plain")
    try:
        os.ftruncate(plain, SIZE)
        with pytest.raises(SandboxError):
            check_sealed(plain, SIZE)
    finally:
        os.close(plain)


def test_a_memfd_grown_by_guests_touching_holes_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.backends.microvm import _snapram

    monkeypatch.setattr(_snapram, "REFILL_SLACK", 8 * PAGE)
    _template_ram(tmp_path / "tmpl")
    save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    fd = snapshot_ram(tmp_path / "snap.ram", SIZE)
    ino = os.fstat(fd).st_ino
    guest = mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE)  # what a restored VM maps
    for page in (0, 5, 40):  # pages with data: copied on write, the memfd unchanged
        guest[page * PAGE] = 1
    assert os.fstat(snapshot_ram(tmp_path / "snap.ram", SIZE)).st_ino == ino
    for page in range(8, 30):  # holes: each first touch allocates a zero page in the memfd
        guest[page * PAGE] = 1
    fresh = snapshot_ram(tmp_path / "snap.ram", SIZE)
    assert os.fstat(fresh).st_ino != ino
    assert os.fstat(fresh).st_blocks * 512 <= 4 * PAGE  # only the saved data
    assert guest[5 * PAGE : 5 * PAGE + 2] == b"\x01B"  # the running VM keeps its mapping
    guest.close()


def test_another_process_of_ours_adopts_the_same_memfd(tmp_path: Path) -> None:
    from agentbox.backends.microvm import _snapram

    _template_ram(tmp_path / "tmpl")
    save_ram(tmp_path / "tmpl", tmp_path / "snap.ram")
    ref = ram_ref(tmp_path / "snap.ram", SIZE)
    held = int(str(ref["fd"]))
    _snapram._memfds.clear()  # as a new process (the monitor): held stays the launcher's
    try:
        assert adopt_ram(ref)
        fd = snapshot_ram(tmp_path / "snap.ram", SIZE)
        assert fd != held and os.fstat(fd).st_ino == os.fstat(held).st_ino  # one memfd
        with (tmp_path / "plain").open("wb") as f:
            f.truncate(SIZE)
        plain = os.open(tmp_path / "plain", os.O_RDONLY)
        try:
            assert not adopt_ram({**ref, "fd": plain})  # not a sealed memfd
        finally:
            os.close(plain)
        assert not adopt_ram({**ref, "pid": 2**22 + 1})  # that process is gone
        (tmp_path / "tmpl").replace(tmp_path / "snap.ram")  # the snapshot was re-saved
        assert not adopt_ram(ref)
    finally:
        os.close(held)
