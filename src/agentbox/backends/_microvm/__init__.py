"""What the microVM backends share: the qemu backend (:mod:`agentbox.backends.qemu`) and
the firecracker backend (:mod:`agentbox.backends.firecracker`) differ only in the VMM they
start; their VM dirs, owner records and crash recovery (:mod:`._recover`) are one.

Below both backends, so neither imports the other's private modules.
"""

from __future__ import annotations

from agentbox.backends._microvm._recover import (
    kill_sandbox,
    recover_sandbox,
    replace_workspace,
    vmm_uid,
)

__all__ = ["kill_sandbox", "recover_sandbox", "replace_workspace", "vmm_uid"]
