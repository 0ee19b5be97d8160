"""The podman backend's rows in ``agentbox doctor``, and whether this host can run it:
podman itself, the OCI runtimes it drives, cgroups, user namespaces and root's kernel
quotas its sandboxes draw on."""

from __future__ import annotations

import shutil
from pathlib import Path

from agentbox.backends.oci._userns_limits import (
    HOST_SANDBOXES,
    HOST_SYSCTLS,
    SANDBOX_CAPS,
    host_shortfall,
)
from agentbox.backends.registry import DoctorRow
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError


def facility(settings: Settings) -> _host.Facility:
    """podman usable as root here."""
    del settings
    return _host.podman()


def doctor_rows(settings: Settings) -> list[DoctorRow]:
    """podman (essential), each runtime (the first, the default, essential; one that brings
    its own kernel says so), cgroups, user namespaces, root's kernel quotas."""
    from agentbox.backends.podman._backend import PodmanBackend

    rows = [DoctorRow(_host.podman(), essential=True)]
    podman = PodmanBackend(settings)
    for i, rt in enumerate(podman.runtimes):
        fac = _host.podman_runtime(rt)
        if fac.ok and not podman.shares_host_kernel(rt):
            fac = _host.Facility(
                fac.name, True, f"{fac.detail} (gVisor; network off at the {rt} level)"
            )
        rows.append(DoctorRow(fac, essential=i == 0, present=shutil.which(rt) is not None))
    rows.append(DoctorRow(_cgroups()))
    rows.append(DoctorRow(_userns()))
    rows.append(DoctorRow(_kernel_quotas(), present=True))
    return rows


def _cgroups() -> _host.Facility:
    mode = _host.cgroup_mode()
    if mode == "v2":
        return _host.Facility("cgroups", True, "v2 (unified)")
    return _host.Facility(
        "cgroups",
        True,
        f"{mode}: runc works; crun needs the unified (v2) hierarchy",
        "boot with systemd.unified_cgroup_hierarchy=1 for crun",
    )


def _userns() -> _host.Facility:
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = -1
    if limit == 0:
        return _host.Facility(
            "user namespaces",
            False,
            "max_user_namespaces is 0",
            "sysctl user.max_user_namespaces=15000",
        )
    if shutil.which("unshare") is None:
        return _host.Facility(
            "user namespaces", False, "unshare not installed", "apt-get install util-linux"
        )
    try:
        _proc.run(["unshare", "--user", "--map-root-user", "true"], timeout=15)
    except AgentboxError as exc:
        return _host.Facility(
            "user namespaces",
            False,
            f"unshare -U failed: {str(exc).splitlines()[-1]}",
            "enable user namespaces (sysctl kernel.unprivileged_userns_clone=1)",
        )
    return _host.Facility("user namespaces", True, f"unshare -U works (max {limit})")


def _kernel_quotas() -> _host.Facility:
    """Root's host-wide inotify limits: every podman sandbox's user namespace is root's,

    so each may spend up to its cap of them (see :mod:`agentbox.backends.oci._userns_limits`).
    """
    short = host_shortfall()
    caps = (
        f"per sandbox {SANDBOX_CAPS['max_inotify_instances']} inotify instances, "
        f"{SANDBOX_CAPS['max_inotify_watches']} watches"
    )
    if not short:
        return _host.Facility(
            "kernel quotas", True, f"root's inotify limits leave room for {HOST_SANDBOXES} "
            f"sandboxes at their caps ({caps})"
        )  # fmt: skip
    seen = ", ".join(f"{k}={have} (want >= {want})" for k, (have, want) in short.items())
    fix = "scripts/setup.sh, or sysctl -w " + " ".join(f"{k}={v}" for k, v in HOST_SYSCTLS.items())
    return _host.Facility(
        "kernel quotas",
        False,
        f"{seen}: a few sandboxes at their caps ({caps}) could spend root's inotify quota",
        fix,
    )
