"""Every backend test goes through the leak guard (issue 14: "the leak-check fixture
guards every backend test"), or is listed here as not converted yet.

A test module that builds a real backend (``get_backend(...)``, ``PodmanBackend(...)``,
…) must make its sandboxes through ``sandbox_factory`` (``tests/integration/conftest.py``:
after the test, no process, cgroup, container, VM dir, socket or env fd of them may
remain; on a failure their posture and logs are saved). ``PENDING`` names the modules
that do not yet; it may only shrink.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: Building a real backend in a test module.
_BUILDS = re.compile(r"\bget_backend\(|\b(Podman|Qemu|Firecracker|Docker)Backend\(")
#: Going through the guard.
#: (``podman_boxes``: tests/integration/conftest.py's podman backend behind ``sandbox_factory``.)
_GUARDED = re.compile(r"\bsandbox_factory\b|\bSandboxTracker\(|\bpodman_boxes\b")

#: Modules that build a backend without the guard yet (most check their own leftovers:
#: mounts, containers by name, processes), to be converted to ``sandbox_factory``.
#: Empty now: every backend test module goes through the guard; keep it so.
PENDING: set[str] = set()

#: Modules that name a backend without making a sandbox of it (traits only).
NO_SANDBOX = {
    "escape/test_verdicts.py",  # asks podman's shares_host_kernel, runs no sandbox
    "integration/test_qemu_firecracker.py",  # firecracker's check() refuses; nothing starts
    # a DockerBackend on a stand-in socket (the list parser); its one container is made
    # and removed by the docker CLI in the test, never started
    "integration/test_docker_lean.py",
    # FirecrackerBackend.check() refusals and the VM config/jail, no VMM started
    "integration/test_firecracker.py",
    "integration/test_sandbox_spec.py",  # get_backend's names only
}


def _unguarded() -> set[str]:
    out = set()
    for path in TESTS.rglob("test_*.py"):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith("unit/"):
            continue  # the fake backend, in-process: its own live-sandbox check
        text = path.read_text()
        if _BUILDS.search(text) and not _GUARDED.search(text):
            out.add(rel)
    return out


def test_every_backend_test_module_uses_the_leak_guard() -> None:
    new = sorted(_unguarded() - PENDING - NO_SANDBOX)
    assert not new, f"backend tests without sandbox_factory (use it): {new}"


def test_pending_only_shrinks() -> None:
    done = sorted(PENDING - _unguarded())
    assert not done, f"guarded now (or gone): remove from PENDING: {done}"


def test_leaky_names_only_existing_modules() -> None:
    # conftest.LEAKY (ResourceWarning not an error yet) may only shrink: a renamed or
    # deleted module leaves it, and nothing new is added to dodge strictness.
    spec = importlib.util.spec_from_file_location("_tests_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    gone = sorted(m for m in root.LEAKY if not (TESTS / m).is_file() or m.startswith("unit/"))
    assert not gone, f"not a module outside tests/unit/: remove from LEAKY: {gone}"
