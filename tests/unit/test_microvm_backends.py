"""The two microVM backends share one base, and the qemu backend is a package (issue 14).

:class:`~agentbox.backends.microvm._base._MicrovmBackend` holds what qemu and firecracker
have in common (mount checks, the VM's shape, ``create``'s steps, ``run``, the verbs
for a dead owner's sandbox); each backend only starts its own VMM. Neither backend
class extends the other, so a change to QEMU's snapshots or accelerator probe cannot
reach Firecracker by inheritance. ``agentbox.backends.microvm.qemu`` keeps its public names.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import agentbox.backends.microvm.qemu as qemu_pkg
from agentbox.backends import backend_class
from agentbox.backends.base import LABEL
from agentbox.backends.microvm._base import _MicrovmBackend
from agentbox.config import Settings

SRC = Path(__file__).resolve().parents[2] / "src" / "agentbox" / "backends"


def test_qemu_and_firecracker_share_a_base_and_neither_extends_the_other() -> None:
    qemu, fc = backend_class("qemu"), backend_class("firecracker")
    assert issubclass(qemu, _MicrovmBackend) and issubclass(fc, _MicrovmBackend)
    assert not issubclass(fc, qemu) and not issubclass(qemu, fc)
    # Each fills in the hooks itself: none is the base's placeholder.
    for cls in (qemu, fc):
        for hook in ("check", "accel", "_vm", "_start", "_sandbox"):
            assert getattr(cls, hook) is not getattr(_MicrovmBackend, hook), (cls, hook)


def test_the_firecracker_backend_imports_nothing_of_the_qemu_backend_class() -> None:
    tree = ast.parse((SRC / "microvm" / "firecracker" / "_backend.py").read_text())
    names = {
        (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    assert not {n for n in names if n[1] == "QemuBackend" or "qemu._backend" in (n[0] or "")}


def test_the_qemu_package_keeps_its_public_names() -> None:
    assert (SRC / "microvm" / "qemu" / "__init__.py").is_file()
    assert not (SRC / "qemu").exists() and not (SRC / "qemu.py").exists()
    want = {"QemuBackend", "QemuSandbox", "kill_sandbox", "probe_kvm", "recover_sandbox", "vmm_uid"}
    want |= {"doctor_rows", "facility"}  # the registry's probes
    assert set(qemu_pkg.__all__) == want
    assert all(callable(getattr(qemu_pkg, name)) for name in want)


@pytest.mark.parametrize("backend", ["qemu", "firecracker"])
def test_both_backends_read_the_same_vm_dirs(backend: str, tmp_path: Path) -> None:
    """The shared verbs, without a VM: the sandboxes an owner record names are listed by
    either backend, and killing by name finds the VM dir (no VMM runs in its cgroup)."""
    settings = Settings(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    vm_dir = settings.data_dir / "microvm" / "t-1-abc123"
    vm_dir.mkdir(parents=True)
    (vm_dir / "owner").write_text(json.dumps({"pid": 1, LABEL: "t-1", "workspace": None}))
    b = backend_class(backend)(settings)  # type: ignore[call-arg]
    assert b.owned() == ["t-1"]
    assert b.kill("t-1") == ["t-1-abc123"]
    assert b.kill("t-2") == []
