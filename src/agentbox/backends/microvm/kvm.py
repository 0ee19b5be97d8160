"""Whether this host's KVM can really boot our guest: probed once by booting it, cached.

``/dev/kvm`` existing proves little: on a host that is itself a PVM guest
(``kvm_pvm``) a stock kernel dies with emulation failures. So the probe boots
the real kernel and initramfs under ``-accel kvm`` to the marker, with a
timeout, and caches the verdict (keyed by host kernel, boot and QEMU) in the
cache dir. A probe that could not run (QEMU refused its own command line, e.g.
a disk lock held by another process) says so and is neither cached nor taken as
KVM failing; a failed boot is retried before that negative verdict is cached,
because it puts every microVM on TCG (about 20x slower).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError

__all__ = ["probe_kvm"]

log = get_logger(__name__)

PROBE_TIMEOUT = 30.0
#: Boots a failed KVM verdict takes before it is cached (a busy host can miss one).
PROBE_TRIES = 2
_memo: dict[str, _host.Facility] = {}


def _key(settings: Settings) -> str:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{os.uname().release}|{boot}|{settings.qemu_binary}"


def probe_kvm(settings: Settings) -> _host.Facility:
    """A :class:`~agentbox.core.host.Facility` saying whether ``-accel kvm`` boots our guest."""
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
    for attempt in range(PROBE_TRIES):
        fac, could_run = _probe(settings)
        if fac.ok or not could_run or attempt + 1 == PROBE_TRIES:
            break
        log.info("kvm probe failed, retrying", attempt=attempt + 1, detail=fac.detail)
    if not could_run:
        return fac  # not KVM's verdict: the next caller probes again
    _memo[key] = fac
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "ok": fac.ok, "detail": fac.detail,
                                     "fix": fac.fix}))  # fmt: skip
    except OSError:
        pass
    return fac


def _probe(settings: Settings) -> tuple[_host.Facility, bool]:
    """The verdict, and whether the probe could run at all (False: not about KVM)."""
    if not Path("/dev/kvm").exists():
        return _host.Facility(
            "kvm", False, "no /dev/kvm", "enable KVM (or nested virt); TCG works"
        ), True
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return _host.Facility(
            "kvm", False, "/dev/kvm not accessible", "add yourself to group kvm"
        ), True
    if not _host.qemu(settings.qemu_binary).ok:
        return _host.Facility(
            "kvm", False, "qemu not installed", "apt-get install qemu-system-x86"
        ), True
    try:
        boot = boot_guest(settings, accel="kvm", timeout=PROBE_TIMEOUT)
    except AgentboxError as exc:
        return _not_run(str(exc)), False
    if boot.reached:
        return _host.Facility("kvm", True, f"booted the guest under KVM in {boot.detail}"), True
    if not boot.could_run:
        return _not_run(boot.detail), False
    return _host.Facility(
        "kvm",
        False,
        f"KVM cannot boot a stock guest kernel here ({boot.detail}); using TCG",
        "a host with VT-x/AMD-V (this one may be a PVM guest)",
    ), True


def _not_run(detail: str) -> _host.Facility:
    return _host.Facility(
        "kvm", False, f"KVM probe could not run: {detail}", "run agentbox doctor again"
    )


@dataclass(frozen=True)
class Boot:
    """How a bare boot to the marker ended."""

    reached: bool
    detail: str
    #: False when QEMU exited before the guest printed anything and its error does not
    #: name KVM: its own set-up failed (a disk lock, a missing file), not the guest.
    could_run: bool = True
    #: QEMU's CPU seconds (user + system) when the marker came (0 if it never did).
    cpu: float = 0.0


def exited_before_guest(log_tail: str, guest_output: bytes) -> bool:
    """Whether a QEMU exit is its own set-up failing rather than the guest or KVM."""
    return not guest_output and "kvm" not in log_tail.lower()


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

    Used by the benchmark's baseline (the marker comes from the image's python in the
    chroot); the KVM probe uses :func:`boot_guest`.
    """
    boot = boot_guest(
        settings, accel=accel, timeout=timeout, root_disk=root_disk,
        memory_mib=memory_mib, cpus=cpus,
    )  # fmt: skip
    return boot.reached, boot.detail


def boot_guest(
    settings: Settings,
    *,
    accel: str,
    timeout: float,
    root_disk: Path | None = None,
    memory_mib: int = 512,
    cpus: int = 1,
) -> Boot:
    """Boot our kernel + initramfs bare to the marker. Without ``root_disk``
    (``agentbox_probe=1``: /init prints the marker once its modules load) the root
    drive is an empty file of its own, so no other process's lock can refuse it."""
    from agentbox.backends.microvm._initramfs import MARKER, ensure_initramfs
    from agentbox.backends.microvm._kernel import ensure_kernel
    from agentbox.backends.microvm._vm import Vm, VmConfig

    kernel = ensure_kernel(settings)
    initramfs = ensure_initramfs(settings, kernel)
    want = MARKER.encode()
    with tempfile.TemporaryDirectory(prefix="agentbox-probe-") as tmp:
        if root_disk is None:
            blank = Path(tmp) / "blank.img"
            blank.write_bytes(b"\0" * 512)
        cfg = VmConfig(
            name=f"probe-{os.getpid()}", kernel=kernel, initramfs=initramfs,
            root_disk=root_disk or blank, data_disk=None,
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
                    return Boot(False, f"no marker within {timeout:g}s")
                ready, _, _ = select.select([r], [], [], left)
                if not ready:
                    continue
                chunk = os.read(r, 65536)
                if not chunk:
                    tail = vm.log_tail(400).strip()
                    return Boot(
                        False,
                        f"QEMU exited: {tail or buf[-300:]!r}",
                        could_run=not exited_before_guest(tail, buf),
                    )
                buf = (buf + chunk)[-65536:]
            cpu = 0.0
            if vm.proc is not None:  # no jail: the process is QEMU itself
                with contextlib.suppress(psutil.Error):
                    times = psutil.Process(vm.proc.pid).cpu_times()
                    cpu = times.user + times.system
            return Boot(True, f"{time.monotonic() - t0:.2f}s", cpu=cpu)
        finally:
            if w >= 0:
                os.close(w)
            os.close(r)
            vm.kill()
            shutil.rmtree(tmp, ignore_errors=True)
