"""The KVM probe (``agentbox doctor``, the qemu backend's accelerator choice) tells a
probe that could not run from a KVM that failed, and no other QEMU's disk lock can
make it fail: a wrong negative verdict, once cached, puts every microVM on TCG."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.microvm import kvm
from agentbox.backends.microvm.kvm import boot_to_marker, probe_kvm
from agentbox.config import Settings

pytestmark = pytest.mark.qemu


@pytest.fixture
def dev_null_held() -> Iterator[None]:
    """Another QEMU holding /dev/null as a writable disk (its write lock refuses the
    shared lock a second QEMU's read-only drive on /dev/null asks for)."""
    qemu = subprocess.Popen(
        ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-nodefaults", "-nographic",
         "-S", "-drive", "id=x,file=/dev/null,format=raw,if=none",
         "-device", "virtio-blk-device,drive=x"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # Held once a second QEMU is refused the same drive.
        probe = ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-nodefaults",
                 "-nographic", "-S", "-drive", "id=y,file=/dev/null,format=raw,if=none,readonly=on",
                 "-device", "virtio-blk-device,drive=y", "-qmp", "stdio"]  # fmt: skip
        for _ in range(100):
            r = subprocess.run(probe, input=b"", capture_output=True, timeout=30, check=False)
            if b"lock" in r.stderr:
                break
        else:
            pytest.fail("the holding QEMU never took its lock on /dev/null")
        yield
    finally:
        qemu.kill()
        qemu.wait()
        assert qemu.stderr is not None
        qemu.stderr.close()


def test_the_bare_boot_is_not_refused_by_another_qemus_lock(dev_null_held: None) -> None:
    reached, detail = boot_to_marker(Settings(), accel="tcg", timeout=300)
    assert reached, detail


def _fake_qemu(tmp_path: Path, stderr: str) -> Path:
    """A qemu-system-x86_64 that fails at once with ``stderr`` (and counts its runs)."""
    script = tmp_path / "qemu-system-x86_64"
    script.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\necho '{stderr}' >&2\nexit 1\n")
    script.chmod(0o755)
    return script


def _runs(tmp_path: Path) -> int:
    runs = tmp_path / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


@pytest.fixture
def probe_settings(tmp_path: Path) -> Settings:
    if not Path("/dev/kvm").exists():
        pytest.skip("the probe boots only where /dev/kvm exists")
    # The default cache: the guest kernel and initramfs are built there once.
    return Settings()


def _verdict(settings: Settings) -> dict[str, object] | None:
    cache = settings.cache_dir / "microvm" / "kvm-verdict.json"
    data = json.loads(cache.read_text()) if cache.exists() else None
    return data if data and data.get("key") == kvm._key(settings) else None


def test_a_probe_that_could_not_run_is_no_verdict(tmp_path: Path, probe_settings: Settings) -> None:
    lock = (
        "qemu-system-x86_64: -device virtio-blk-device,drive=root: "
        'Failed to get "consistent read" lock'
    )
    settings = probe_settings.model_copy(update={"qemu_binary": str(_fake_qemu(tmp_path, lock))})
    fac = probe_kvm(settings)
    assert not fac.ok
    assert fac.detail.startswith("KVM probe could not run") and "consistent read" in fac.detail
    assert "cannot boot" not in fac.detail
    assert _verdict(settings) is None  # not cached
    assert _runs(tmp_path) == 1  # not retried: it is not KVM's answer
    probe_kvm(settings)
    assert _runs(tmp_path) == 2  # nor remembered: the next caller probes again


def test_a_failed_kvm_boot_is_retried_then_cached(tmp_path: Path, probe_settings: Settings) -> None:
    err = "qemu-system-x86_64: KVM internal error. Suberror: 1 emulation failure"
    settings = probe_settings.model_copy(update={"qemu_binary": str(_fake_qemu(tmp_path, err))})
    cache = settings.cache_dir / "microvm" / "kvm-verdict.json"
    before = cache.read_bytes() if cache.exists() else None
    try:
        fac = probe_kvm(settings)
        assert not fac.ok and "KVM cannot boot" in fac.detail
        assert _runs(tmp_path) == kvm.PROBE_TRIES > 1
        assert _verdict(settings) is not None
    finally:  # the host's own verdict stays
        kvm._memo.pop(kvm._key(settings), None)
        if before is None:
            cache.unlink(missing_ok=True)
        else:
            cache.write_bytes(before)
