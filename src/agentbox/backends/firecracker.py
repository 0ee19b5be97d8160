"""The firecracker backend: a user-installed Firecracker under its jailer, where KVM works.

No registry we reach ships a Firecracker binary, so this backend uses the one
the user configured (``Settings.firecracker_binary``, with ``jailer`` next to
it) and refuses, naming the fix, where there is none or where KVM cannot boot
our guest (:func:`agentbox.microvm.probe_kvm`; on a PVM host it cannot).

It shares the guest side with the qemu backend: the same PVH vmlinux,
initramfs, root and ``/data`` disks. What differs is the channel: Firecracker
has no virtio-serial, only vsock (a host unix socket per port through its
hybrid vsock), which the guest agent does not speak yet; so on a host where
everything else is present :meth:`FirecrackerBackend.check` still refuses,
saying so, rather than starting a VM it cannot talk to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from agentbox.backends.base import ExecResult, OutputCallback, Sandbox, SandboxSpec
from agentbox.config import Settings
from agentbox.errors import UnsupportedError
from agentbox.microvm.kvm import probe_kvm

__all__ = ["FirecrackerBackend", "firecracker_binaries"]


def firecracker_binaries(settings: Settings) -> tuple[Path, Path]:
    """The configured ``firecracker`` and its ``jailer``; UnsupportedError if missing."""
    fc = settings.firecracker_binary
    if fc is None:
        raise UnsupportedError(
            "no firecracker binary configured",
            fix="install Firecracker and set AGENTBOX_FIRECRACKER_BINARY=/path/to/firecracker",
        )
    if not (fc.is_file() and os.access(fc, os.X_OK)):
        raise UnsupportedError(f"firecracker binary {fc} is not executable", fix="check the path")
    jailer = fc.with_name("jailer")
    if not (jailer.is_file() and os.access(jailer, os.X_OK)):
        raise UnsupportedError(f"no jailer next to {fc}", fix="install Firecracker's jailer too")
    return fc, jailer


class FirecrackerBackend:
    """Makes Firecracker microVM sandboxes (``name = "firecracker"``)."""

    name = "firecracker"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def check(self, spec: SandboxSpec) -> None:
        """Refuse, naming the fix, unless Firecracker, its jailer and a working KVM are here."""
        firecracker_binaries(self.settings)
        kvm = probe_kvm(self.settings)
        if not kvm.ok:
            raise UnsupportedError(f"Firecracker needs KVM: {kvm.detail}", fix=kvm.fix)
        raise UnsupportedError(
            "the guest agent has no vsock transport yet (Firecracker has no virtio-serial)",
            fix="use --backend qemu, which runs the same guest",
        )

    def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox; today always refuses through :meth:`check`."""
        self.check(spec)
        raise AssertionError("unreachable")  # pragma: no cover

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """One-shot run; today always refuses through :meth:`check`."""
        self.check(spec)
        raise AssertionError("unreachable")  # pragma: no cover

    def cleanup_orphans(self) -> list[str]:
        """Nothing to clean: no Firecracker sandbox is ever started."""
        return []
