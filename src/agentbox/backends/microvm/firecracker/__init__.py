"""The firecracker backend: every sandbox a Firecracker microVM started by its jailer.

The package's public names; the backend, its VM and its sandbox are in
:mod:`._backend`. See docs/reference/firecracker-backend.md.
"""

from __future__ import annotations

from agentbox.backends.microvm.firecracker._backend import (
    FirecrackerBackend,
    FirecrackerSandbox,
    FirecrackerVm,
    doctor_rows,
    facility,
    fc_uid,
    firecracker_binaries,
)

__all__ = [
    "FirecrackerBackend",
    "FirecrackerSandbox",
    "FirecrackerVm",
    "doctor_rows",
    "facility",
    "fc_uid",
    "firecracker_binaries",
]
