"""Probes of what this host can do, shared by ``agentbox doctor`` and the test suite.

Each probe returns a :class:`Facility`: whether it is usable, what was seen,
and how to fix it. Probes are cached per process; they never raise.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError

__all__ = [
    "Facility",
    "cgroup_mode",
    "claude_code",
    "podman",
    "podman_runtime",
    "qemu",
]


@dataclass(frozen=True)
class Facility:
    """A probed host facility."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def cgroup_mode() -> str:
    """``v2`` (unified), ``hybrid`` or ``v1``."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "v2"
    if Path("/sys/fs/cgroup/unified").is_dir():
        return "hybrid"
    return "v1"


@functools.cache
def podman() -> Facility:
    """podman usable as root (``podman info`` answers)."""
    if shutil.which("podman") is None:
        return Facility("podman", False, "podman not installed", "apt-get install podman runc")
    if os.geteuid() != 0:
        return Facility("podman", False, "agentbox drives podman as root", "run as root")
    try:
        res = _proc.run(["podman", "version", "--format", "{{.Client.Version}}"], timeout=30)
    except AgentboxError as exc:
        return Facility("podman", False, f"podman does not answer: {exc}", "check podman info")
    return Facility("podman", True, f"podman {res.stdout.strip()}")


@functools.cache
def podman_runtime(runtime: str) -> Facility:
    """Whether podman can use OCI runtime ``runtime`` here, and why not."""
    name = f"runtime {runtime}"
    binary = shutil.which(runtime)
    if binary is None:
        pkg = {"runsc": "runsc"}.get(runtime, runtime)
        return Facility(name, False, f"{runtime} not installed", f"apt-get install {pkg}")
    if runtime == "crun" and cgroup_mode() != "v2":
        return Facility(
            name,
            False,
            f"crun refuses cgroups in {cgroup_mode()} mode here",
            "boot with systemd.unified_cgroup_hierarchy=1, or use runc",
        )
    return Facility(name, True, binary)


@functools.cache
def qemu(binary: str = "qemu-system-x86_64") -> Facility:
    """The QEMU system emulator."""
    path = shutil.which(binary)
    if path is None:
        return Facility("qemu", False, f"{binary} not installed", "apt-get install qemu-system-x86")
    return Facility("qemu", True, path)


def claude_code(binary: Path) -> Facility:
    """The pinned Claude Code native binary."""
    if binary.is_file() and os.access(binary, os.X_OK):
        return Facility("claude", True, str(binary))
    return Facility("claude", False, f"not found at {binary}", "scripts/setup.sh")
