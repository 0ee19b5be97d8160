"""Reading a live docker sandbox's posture: inside (the shared probe) and from the host.

Inside: the same stdlib probe podman's posture runs (ids, capability sets,
no_new_privs, seccomp, interfaces, mounts), its output untrusted and only
compared. Host: ``docker inspect`` (the seed's smoke test reads exactly these
fields) and ``/proc`` of every thread of the container's cgroup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentbox.backends.base import Posture, PostureCheck, SandboxSpec
from agentbox.backends.docker._config import (
    TINI,
    DaemonFacts,
    docker_runtime,
    nano_cpus,
    seccomp_json,
)
from agentbox.backends.oci._posture import (
    NAMESPACES,
    _check,
    _inside_checks,
    all_same,
    expected_mounts,
    probe_inside,
    process_checks,
)
from agentbox.config import Settings

if TYPE_CHECKING:
    from agentbox.backends.docker._sandbox import DockerSandbox

#: Checks of podman's that do not apply (none: the userns caps are set from the host).
_NOT_HERE: set[str] = set()


def inspect_checks(
    spec: SandboxSpec, facts: DaemonFacts, info: dict[str, Any], want_seccomp: str
) -> list[PostureCheck]:
    """The seed's ``docker inspect`` checks, literally (``want_seccomp``: our profile's
    ``seccomp=<json>`` security option)."""
    hc = info.get("HostConfig") or {}
    cfg = info.get("Config") or {}
    nets = (info.get("NetworkSettings") or {}).get("Networks") or {}
    res = spec.resources
    ulimits = {u.get("Name"): (u.get("Soft"), u.get("Hard")) for u in hc.get("Ulimits") or []}
    mounts = sorted(str(m.get("Destination")) for m in info.get("Mounts") or [])
    secopt = [str(s) for s in hc.get("SecurityOpt") or []]
    checks = [
        _check("runtime", docker_runtime(spec), hc.get("Runtime"), where="host"),
        _check("NetworkMode", "none", hc.get("NetworkMode"), where="host"),
        # NetworkDisabled: the Engine attaches no network at all, not even "none".
        _check("networks", "none or no network", sorted(nets),
               sorted(nets) in ([], ["none"]), where="host"),
        _check("ReadonlyRootfs", True, hc.get("ReadonlyRootfs"), where="host"),
        _check("CapDrop", ["ALL"], hc.get("CapDrop"), where="host"),
        _check("CapAdd", [], hc.get("CapAdd") or [], where="host"),
        _check("Privileged", False, hc.get("Privileged"), where="host"),
        _check("no-new-privileges", True, "no-new-privileges" in secopt, where="host"),
        # Exactly the profile agentbox derived (the same file podman uses), not a default.
        _check("seccomp profile (agentbox's)", True, want_seccomp in secopt, where="host"),
        _check("User", f"{spec.uid}:{spec.uid}", cfg.get("User"), where="host"),
        _check("IpcMode", "private", hc.get("IpcMode"), where="host"),
        _check("init (tini) is PID 1", [TINI, "--"], cfg.get("Entrypoint"), where="host"),
        _check("PidsLimit", res.pids, hc.get("PidsLimit"), where="host"),
        _check("Memory = MemorySwap", res.memory,
               hc.get("Memory") if hc.get("Memory") == hc.get("MemorySwap") else "swap allowed",
               where="host"),
        _check("NanoCpus", nano_cpus(res.cpus), hc.get("NanoCpus"), where="host"),
        _check("nofile", (res.nofile, res.nofile), ulimits.get("nofile"), where="host"),
        _check("tmpfs", ["/home/agent", "/tmp"], sorted(hc.get("Tmpfs") or {}), where="host"),
        _check("mounts (inspect)", sorted(expected_mounts(spec)), mounts, where="host"),
        _check("userns-remap", facts.userns_mode, facts.userns_mode, where="host"),
    ]  # fmt: skip
    if facts.apparmor:
        checks.append(_check("AppArmorProfile", "docker-default", info.get("AppArmorProfile"),
                             where="host"))  # fmt: skip
    else:
        checks.append(_check("AppArmor (host has none)", "unavailable", "unavailable",
                             where="host"))  # fmt: skip
    return checks


def _proc_checks(spec: SandboxSpec, facts: DaemonFacts, info: dict[str, Any]) -> list[PostureCheck]:
    pid = int((info.get("State") or {}).get("Pid") or 0)
    if pid <= 0:
        return [_check("container process", "running", "not running", where="host")]
    gvisor = spec.runtime == "runsc"
    kinds: tuple[str, ...] = ("net", "ipc", "mnt") if gvisor else NAMESPACES
    if facts.remap_base is None:
        kinds = tuple(k for k in kinds if k != "user")
    checks, threads = process_checks(pid, kinds)
    if not gvisor:
        want = "\t".join([str(facts.host_uid(spec.uid))] * 4)
        uids = all_same([st.get("Uid", "?") for _, _, st in threads])
        caps = all_same([st.get("CapEff", "?") for _, _, st in threads])
        checks.append(_check("host uid (every thread)", want, uids, where="host"))
        checks.append(_check("CapEff (every thread)", "0000000000000000", caps, where="host"))
    return checks


def read_posture(box: DockerSandbox, settings: Settings, facts: DaemonFacts) -> Posture:
    """Inside and host checks of a running docker sandbox."""
    inside = [c for c in _inside_checks(box.spec, probe_inside(box)) if c.name not in _NOT_HERE]
    info = box.inspect()
    want = f"seccomp={seccomp_json(settings, box.spec.runtime)}"
    checks = (
        inside + inspect_checks(box.spec, facts, info, want) + _proc_checks(box.spec, facts, info)
    )
    return Posture("docker", box.spec.runtime, tuple(checks))
