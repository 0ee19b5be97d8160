"""What the microVM backends share: the qemu backend (:mod:`agentbox.backends.qemu`) and
the firecracker backend (:mod:`agentbox.backends.firecracker`) differ only in the VMM they
start and how they reach its guest agent.

* :mod:`._base`: :class:`_MicrovmBackend`, the base class both subclass: traits,
  mount checks, the VM's shape, ``create``'s steps, ``run``, and the verbs for a
  sandbox whose owner died;
* :mod:`._recover`: VM dirs, owner records, killing by name and crash recovery.

Below both backends, so neither backend class extends the other. (The live sandbox,
which never asks which VMM runs it, is :class:`agentbox.backends.qemu.QemuSandbox`;
the firecracker backend's extends it.)
"""

from __future__ import annotations

from agentbox.backends._microvm._base import _MicrovmBackend
from agentbox.backends._microvm._recover import (
    kill_sandbox,
    recover_sandbox,
    replace_workspace,
    vmm_uid,
)

__all__ = [
    "_MicrovmBackend",
    "kill_sandbox",
    "recover_sandbox",
    "replace_workspace",
    "vmm_uid",
]
