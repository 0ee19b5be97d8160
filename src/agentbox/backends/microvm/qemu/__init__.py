"""The qemu backend: every sandbox a QEMU microVM with its own kernel and a confined VMM.

The package's public names; the implementation is split by job:

* :mod:`._backend`: :class:`QemuBackend`: checks a spec, boots or restores a VM;
* :mod:`._sandbox`: :class:`QemuSandbox`: a live VM reached through its guest agent;
* :mod:`._posture`: the posture read off the running VMM and from inside the guest;
* :mod:`._detach`, :mod:`._records`, :mod:`._monitor`: detached VMs, held by a
  monitor process of ours that outlives its launcher.

What it shares with the firecracker backend (the base class
:class:`~agentbox.backends.microvm._base._MicrovmBackend`, VM dirs, owner records, crash
recovery) lives beside both, in :mod:`agentbox.backends.microvm._base` and
:mod:`agentbox.backends.microvm._recover`.

See docs/reference/qemu-backend.md and docs/explanation/microvm-isolation.md.
"""

from __future__ import annotations

from agentbox.backends.microvm._recover import kill_sandbox, recover_sandbox, vmm_uid
from agentbox.backends.microvm.kvm import probe_kvm
from agentbox.backends.microvm.qemu._backend import QemuBackend
from agentbox.backends.microvm.qemu._doctor import doctor_rows, facility
from agentbox.backends.microvm.qemu._sandbox import QemuSandbox

__all__ = [
    "QemuBackend",
    "QemuSandbox",
    "doctor_rows",
    "facility",
    "kill_sandbox",
    "probe_kvm",
    "recover_sandbox",
    "vmm_uid",
]
