"""Is a usable Docker Engine here? The doctor's rows and the ``docker`` test marker's probe."""

from __future__ import annotations

import shutil
from pathlib import Path

from agentbox.backends.docker._backend import DockerBackend
from agentbox.backends.docker._config import RUNSC_GATEWAY_RUNTIME, DaemonFacts
from agentbox.backends.registry import DoctorRow
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.errors import AgentboxError

_SETUP = "scripts/setup.sh (installs docker.io, starts dockerd, registers runsc)"


def _facts(settings: Settings) -> DaemonFacts | _host.Facility:
    try:
        return DockerBackend(settings).facts()
    except AgentboxError as exc:
        return _host.Facility("docker", False, str(exc), _SETUP)
    except Exception as exc:  # a probe must not take the whole report down
        return _host.Facility("docker", False, f"probe failed: {exc}", _SETUP)


def facility(settings: Settings) -> _host.Facility:
    """Ok when the daemon answers, has runsc and runsc-gw, and maps ids as agentbox expects."""
    facts = _facts(settings)
    if isinstance(facts, _host.Facility):
        return facts
    missing = [r for r in ("runc", "runsc", RUNSC_GATEWAY_RUNTIME) if r not in facts.runtimes]
    if missing:
        detail = f"runtimes {', '.join(missing)} not registered"
        return _host.Facility(
            "docker", False, detail, "daemon.json: docs/reference/docker-backend.md"
        )
    host_uid = facts.host_uid(settings.sandbox_uid)
    if host_uid != settings.sandbox_host_uid:
        return _host.Facility(
            "docker",
            False,
            f"uid {settings.sandbox_uid} is host uid {host_uid} ({facts.userns_mode}), "
            f"not {settings.sandbox_host_uid}",
            f"userns-remap with subordinate ids from {settings.subid_base} ({_SETUP})",
        )
    return _host.Facility("docker", True, f"Engine {facts.version}, {facts.userns_mode}")


def doctor_rows(settings: Settings) -> list[DoctorRow]:
    """The doctor's rows: "refused" rather than "missing" once the daemon is installed."""
    present = shutil.which("dockerd") is not None or Path("/var/run/docker.sock").exists()
    return [DoctorRow(fac, present=present) for fac in _doctor_facilities(settings)]


def _doctor_facilities(settings: Settings) -> list[_host.Facility]:
    """daemon and version, runtimes, AppArmor, userns-remap: each with its fix."""
    facts = _facts(settings)
    if isinstance(facts, _host.Facility):
        return [facts]
    rows = [
        _host.Facility("docker daemon", True, f"Engine {facts.version} (API {facts.api_version})")
    ]
    missing = [r for r in ("runsc", RUNSC_GATEWAY_RUNTIME) if r not in facts.runtimes]
    rows.append(_host.Facility(
        "docker runtimes", not missing, ", ".join(facts.runtimes),
        "" if not missing else f"register {', '.join(missing)} in /etc/docker/daemon.json "
        "(docs/reference/docker-backend.md)"))  # fmt: skip
    rows.append(_host.Facility(
        "docker AppArmor", facts.apparmor,
        "docker-default applied to every sandbox" if facts.apparmor
        else "the host has no AppArmor: sandboxes run without an LSM profile (seccomp, caps, "
        "no-new-privileges still apply)",
        "" if facts.apparmor else "boot with AppArmor (apparmor=1 security=apparmor)"))  # fmt: skip
    host_uid = facts.host_uid(settings.sandbox_uid)
    ok = host_uid == settings.sandbox_host_uid
    rows.append(_host.Facility(
        "docker userns-remap", ok,
        f"{facts.userns_mode}: sandbox uid {settings.sandbox_uid} is host uid {host_uid}",
        "" if ok else f"userns-remap with subordinate ids from {settings.subid_base} "
        f"(dockremap:{settings.subid_base}:65536 in /etc/subuid and /etc/subgid)"))  # fmt: skip
    return rows
