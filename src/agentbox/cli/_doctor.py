"""``agentbox doctor``: what this host supports, and how to fix each missing piece.

Every row is a :class:`~agentbox.core.host.Facility` probe. The command exits 0 when
the essentials are there (podman, runc, and what ``agentbox image build``
needs); optional pieces (crun, gVisor, KVM, QEMU, bubblewrap) only widen the
choice of backends and runtimes.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, RenderableType
from rich.text import Text

from agentbox.cli._table import Col, fit_table, print_table
from agentbox.config import Settings, load_settings
from agentbox.core import host as _host
from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError

__all__ = ["Check", "checks", "register"]


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table."""

    facility: _host.Facility
    essential: bool
    status: str
    """``ok``, ``missing``, ``refused`` (present but unusable here) or ``partial``."""

    def as_dict(self) -> dict[str, Any]:
        f = self.facility
        return {
            "name": f.name,
            "ok": f.ok,
            "status": self.status,
            "essential": self.essential,
            "detail": f.detail,
            "fix": f.fix,
        }


def _row(fac: _host.Facility, *, essential: bool = False, present: bool | None = None) -> Check:
    if fac.ok:
        return Check(fac, essential, "ok")
    return Check(fac, essential, "refused" if present else "missing")


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

    so each may spend up to its cap of them (see backends/oci/_userns_limits.py).
    """
    from agentbox.backends.podman import (
        HOST_SANDBOXES,
        HOST_SYSCTLS,
        SANDBOX_CAPS,
        host_shortfall,
    )

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


def _kvm(settings: Settings) -> Check:
    dev = Path("/dev/kvm")
    if not dev.exists():
        fac = _host.Facility(
            "kvm", False, "no /dev/kvm", "enable virtualisation (or nested) and load kvm_intel/amd"
        )
        return _row(fac)
    if not os.access(dev, os.R_OK | os.W_OK):
        return _row(
            _host.Facility("kvm", False, "/dev/kvm not writable", "run as root"), present=True
        )
    probe: Callable[[Settings], _host.Facility] | None = None
    try:
        probe = getattr(
            importlib.import_module("agentbox.backends.microvm.qemu"), "probe_kvm", None
        )
    except ImportError:
        probe = None
    if probe is None:
        fac = _host.Facility(
            "kvm", True, "/dev/kvm present (presence only: the qemu backend's boot probe is absent)"
        )
        return Check(fac, False, "partial")
    try:
        fac = probe(settings)
    except Exception as exc:  # a probe must not take the whole report down
        fac = _host.Facility("kvm", False, f"/dev/kvm present; boot probe failed: {exc}", "")
    return _row(fac, present=True)


def _firecracker(settings: Settings) -> Check:
    from agentbox.backends.microvm.firecracker import facility

    return _row(facility(settings), present=settings.firecracker_binary is not None)


def _docker(settings: Settings) -> list[Check]:
    """The docker backend's rows: daemon and version, runtimes, AppArmor, userns-remap."""
    from agentbox.backends.docker import doctor_rows

    present = shutil.which("dockerd") is not None or Path("/var/run/docker.sock").exists()
    return [_row(fac, present=present) for fac in doctor_rows(settings)]


def _binary(name: str, binary: str, package: str, *, what: str = "") -> _host.Facility:
    path = shutil.which(binary)
    if path is None:
        return _host.Facility(name, False, f"{binary} not installed", f"apt-get install {package}")
    return _host.Facility(name, True, f"{path}{what}")


def _apt_sources() -> _host.Facility:
    from agentbox.image import SUITE, host_apt_sources

    try:
        src = host_apt_sources()
    except AgentboxError as exc:
        return _host.Facility("apt sources", False, str(exc), f"add a Debian {SUITE} apt source")
    return _host.Facility(
        "apt sources", True, f"{SUITE} from " + ", ".join(str(p) for p in src.origin)
    )


def _image(settings: Settings) -> _host.Facility:
    from agentbox.image import resolve

    try:
        info = resolve(settings)
    except AgentboxError as exc:
        return _host.Facility("image", False, str(exc), "agentbox image build")
    extra = f", hash {info.hash}" if info.hash else ""
    root = f", root dir {info.rootfs}" if info.rootfs else ""
    return _host.Facility("image", True, f"{info.name}{extra}{root}")


def _models(settings: Settings) -> Check:
    """The model registry loads, and names no model id its provider retired (a warning:
    every task of such an entry would fail at its first request)."""
    from agentbox.gateway.registry import load_registry

    try:
        reg = load_registry(settings)
    except AgentboxError as exc:
        fac = _host.Facility("models", False, str(exc), "fix the models file")
        return Check(fac, False, "refused")
    retired = [e for e in reg if e.retired]
    if not retired:
        return _row(_host.Facility("models", True, f"{len(reg)} entries ({reg.source})"))
    said = "; ".join(
        f"[models.{e.name}] names {e.target_model}, retired by its provider on {e.retired}"
        for e in retired
    )
    fix = f"update the registry ({reg.source}): a current upstream_model (agentbox models)"
    return Check(_host.Facility("models", False, said, fix), False, "partial")


def checks(settings: Settings) -> list[Check]:
    """Probe everything the doctor reports, in display order."""
    from agentbox.backends import get_backend

    pod = _host.podman()
    out = [_row(pod, essential=True)]
    # The OCI runtimes the podman backend drives, asked of it: its first (the default)
    # is essential; one that brings its own kernel (gVisor) says so.
    podman = get_backend("podman", settings)
    for i, rt in enumerate(podman.runtimes):
        fac = _host.podman_runtime(rt)
        if fac.ok and not podman.shares_host_kernel(rt):
            fac = _host.Facility(
                fac.name, True, f"{fac.detail} (gVisor; network off at the {rt} level)"
            )
        out.append(_row(fac, essential=i == 0, present=shutil.which(rt) is not None))
    out.append(_row(_cgroups()))
    out.append(_row(_userns()))
    out.append(_row(_kernel_quotas(), present=True))
    out.append(_kvm(settings))
    out.append(_row(_host.qemu(settings.qemu_binary)))
    out.append(_firecracker(settings))
    out += _docker(settings)
    out.append(_row(_binary("bubblewrap", "bwrap", "bubblewrap")))
    out.append(_row(_binary("mmdebstrap", "mmdebstrap", "mmdebstrap"), essential=True))
    out.append(_row(_apt_sources(), essential=True))
    out.append(_row(_host.claude_code(settings.claude_binary)))
    out.append(_row(_image(settings)))
    out.append(_models(settings))
    return out


_STYLE = {"ok": "green", "partial": "yellow", "missing": "red", "refused": "red"}


def doctor(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Report what this host supports, with a fix for each missing piece."""
    rows = checks(load_settings())
    ok = all(r.facility.ok for r in rows if r.essential)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [r.as_dict() for r in rows]}))
    else:
        console = Console()
        # Never cut: facility and status stay whole, detail and fix fold onto more lines
        # (an ellipsis would hide the one thing the user must type).
        cols = [Col("facility", keep=True), Col("status", keep=True),
                Col("detail", ratio=1), Col("fix", ratio=1)]  # fmt: skip
        cells: list[list[RenderableType]] = []
        for r in rows:
            f = r.facility
            status = f"[{_STYLE[r.status]}]{r.status}[/]" + ("" if not r.essential else " *")
            if r.essential and not f.ok:
                status = f"[bold red]{r.status} *[/]"
            fix = f.fix if not f.ok or f.fix else ""
            cells.append([Text(f.name), Text.from_markup(status), Text(f.detail), Text(fix)])
        print_table(console, fit_table(console, cols, cells))
        console.print(
            "[green]essentials present[/green] (* = essential: podman, runc, image tooling)"
            if ok
            else "[red]an essential piece is missing[/red] (* = essential)"
        )
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``agentbox doctor`` to the CLI."""
    app.command("doctor")(doctor)
