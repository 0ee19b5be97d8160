"""Whether this host's KVM can really boot our guest: probed once by booting it, cached.

``/dev/kvm`` existing proves little: on a host that is itself a PVM guest
(``kvm_pvm``) a stock kernel dies with emulation failures. So the probe boots
the real kernel and initramfs under ``-accel kvm`` to the marker, with a
timeout, and caches the verdict (keyed by host kernel, boot and QEMU) in the
cache dir.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import tempfile
import time
from pathlib import Path

from agentbox import _host
from agentbox._log import get_logger
from agentbox.config import Settings
from agentbox.errors import AgentboxError

__all__ = ["probe_kvm"]

log = get_logger("microvm.kvm")

PROBE_TIMEOUT = 30.0
_memo: dict[str, _host.Facility] = {}


def _key(settings: Settings) -> str:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{os.uname().release}|{boot}|{settings.qemu_binary}"


def probe_kvm(settings: Settings) -> _host.Facility:
    """A :class:`~agentbox._host.Facility` saying whether ``-accel kvm`` boots our guest."""
    key = _key(settings)
    if key in _memo:
        return _memo[key]
    cache = settings.cache_dir / "microvm" / "kvm-verdict.json"
    try:
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            fac = _host.Facility("kvm", bool(data["ok"]), str(data["detail"]), str(data["fix"]))
            _memo[key] = fac
            return fac
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fac = _probe(settings)
    _memo[key] = fac
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "ok": fac.ok, "detail": fac.detail,
                                     "fix": fac.fix}))  # fmt: skip
    except OSError:
        pass
    return fac


def _probe(settings: Settings) -> _host.Facility:
    if not Path("/dev/kvm").exists():
        return _host.Facility("kvm", False, "no /dev/kvm", "enable KVM (or nested virt); TCG works")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return _host.Facility("kvm", False, "/dev/kvm not accessible", "add yourself to group kvm")
    if not _host.qemu(settings.qemu_binary).ok:
        return _host.Facility("kvm", False, "qemu not installed", "apt-get install qemu-system-x86")
    try:
        ok, detail = boot_to_marker(settings, accel="kvm", timeout=PROBE_TIMEOUT)
    except AgentboxError as exc:
        return _host.Facility("kvm", False, f"probe could not run: {exc}", "see agentbox doctor")
    if ok:
        return _host.Facility("kvm", True, f"booted the guest under KVM in {detail}")
    return _host.Facility(
        "kvm",
        False,
        f"KVM cannot boot a stock guest kernel here ({detail}); using TCG",
        "a host with VT-x/AMD-V (this one may be a PVM guest)",
    )


def boot_to_marker(
    settings: Settings,
    *,
    accel: str,
    timeout: float,
    root_disk: Path | None = None,
    memory_mib: int = 512,
    cpus: int = 1,
) -> tuple[bool, str]:
    """Boot our kernel + initramfs bare (no jail) to the init marker; (reached, detail).

    Used by the KVM probe (no root disk: ``agentbox_probe=1`` makes /init print
    the marker once its modules load) and by the benchmark's baseline (the
    marker comes from the image's python in the chroot).
    """
    from agentbox.microvm._initramfs import MARKER, ensure_initramfs
    from agentbox.microvm._kernel import ensure_kernel
    from agentbox.microvm._vm import Vm, VmConfig

    kernel = ensure_kernel(settings)
    initramfs = ensure_initramfs(settings, kernel)
    want = MARKER.encode()
    with tempfile.TemporaryDirectory(prefix="agentbox-probe-") as tmp:
        cfg = VmConfig(
            name=f"probe-{os.getpid()}", kernel=kernel, initramfs=initramfs,
            root_disk=root_disk or Path("/dev/null"), data_disk=None,
            run_dir=Path(tmp) / "run", accel=accel, marker=True, jail=False,
            use_cgroup=False, qemu_binary=settings.qemu_binary, memory_mib=memory_mib, cpus=cpus,
            cmdline_extra=() if root_disk is not None else ("agentbox_probe=1",),
        )  # fmt: skip
        r, w = os.pipe()
        vm = Vm(cfg)
        t0 = time.monotonic()
        try:
            vm.start(stdout_fd=w)
            os.close(w)
            w = -1
            buf = b""
            while want not in buf:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    return False, f"no marker within {timeout:g}s"
                ready, _, _ = select.select([r], [], [], left)
                if not ready:
                    continue
                chunk = os.read(r, 65536)
                if not chunk:
                    return False, f"QEMU exited: {vm.log_tail(400).strip() or buf[-300:]!r}"
                buf = (buf + chunk)[-65536:]
            return True, f"{time.monotonic() - t0:.2f}s"
        finally:
            if w >= 0:
                os.close(w)
            os.close(r)
            vm.kill()
            shutil.rmtree(tmp, ignore_errors=True)
