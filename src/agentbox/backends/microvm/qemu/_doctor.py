"""The qemu backend's rows in ``agentbox doctor`` (KVM, by a real boot; the QEMU binary),
and whether this host can run it."""

from __future__ import annotations

import os
from pathlib import Path

from agentbox.backends.microvm.kvm import probe_kvm
from agentbox.backends.registry import DoctorRow
from agentbox.config import Settings
from agentbox.core import host as _host


def facility(settings: Settings) -> _host.Facility:
    """The QEMU system emulator (TCG runs without KVM)."""
    return _host.qemu(settings.qemu_binary)


def _kvm(settings: Settings) -> DoctorRow:
    dev = Path("/dev/kvm")
    if not dev.exists():
        fac = _host.Facility(
            "kvm", False, "no /dev/kvm", "enable virtualisation (or nested) and load kvm_intel/amd"
        )
        return DoctorRow(fac)
    if not os.access(dev, os.R_OK | os.W_OK):
        return DoctorRow(
            _host.Facility("kvm", False, "/dev/kvm not writable", "run as root"), present=True
        )
    try:
        fac = probe_kvm(settings)
    except Exception as exc:  # a probe must not take the whole report down
        fac = _host.Facility("kvm", False, f"/dev/kvm present; boot probe failed: {exc}", "")
    return DoctorRow(fac, present=True)


def doctor_rows(settings: Settings) -> list[DoctorRow]:
    """KVM (present, writable, boots a guest) and the QEMU binary."""
    return [_kvm(settings), DoctorRow(facility(settings))]
