"""The Engine JSON of a hardened sandbox container, and the daemon facts it depends on.

Each field answers a line of the seed's "Agent container" list, like
:func:`agentbox.backends.oci._args.run_args` does for podman; the comment
next to it says which threat it closes. Nothing here talks to the daemon.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.backends._seccomp import profile_path
from agentbox.backends.base import (
    GATEWAY_DIR_IN_SANDBOX,
    HOME_IN_SANDBOX,
    LABEL,
    WORKSPACE_IN_SANDBOX,
    SandboxSpec,
)
from agentbox.backends.docker._spawn import CLIENT, SPAWNER
from agentbox.backends.oci._args import entry_argv
from agentbox.backends.oci._userns_limits import SANDBOX_RLIMITS
from agentbox.config import Settings

#: The container's own clock (its idle ``sleep``) ends it this long after our watchdog
#: should have: the deadline holds even if agentbox died (podman: conmon's --timeout).
DEADLINE_GRACE = 5
#: The runsc runtime registered for sandboxes with a gateway: the same flags plus
#: ``--host-uds=open`` (connect to the mounted gateway socket, never create one).
RUNSC_GATEWAY_RUNTIME = "runsc-gw"
#: PID 1 of every sandbox: the image's tini (agentbox's images carry it).
TINI = "/usr/bin/tini"


@dataclass(frozen=True)
class DaemonFacts:
    """What the daemon is: version, runtimes, AppArmor, user-namespace remapping."""

    version: str
    api_version: str
    runtimes: tuple[str, ...]
    apparmor: bool
    seccomp: bool
    #: Host id that container id 0 maps to (None: no userns-remap, ids are the host's).
    remap_base: int | None
    root_dir: str

    @property
    def userns_mode(self) -> str:
        """``remap (0 → N)`` or ``host ids``: which of the seed's two models is in force."""
        return f"remap (0 → {self.remap_base})" if self.remap_base is not None else "host ids"

    def host_uid(self, uid: int) -> int:
        """The host uid that sandbox uid ``uid`` is."""
        return uid + (self.remap_base or 0)


def daemon_facts(info: dict[str, Any], version: dict[str, Any]) -> DaemonFacts:
    """Read ``GET /info`` and ``GET /version`` (untrusted shapes: checked, never assumed)."""
    opts = [str(o) for o in info.get("SecurityOptions") or [] if isinstance(o, str)]
    names = {o.split(",")[0].removeprefix("name=") for o in opts}
    root = str(info.get("DockerRootDir") or "")
    base: int | None = None
    if "userns" in names:
        # A remapped daemon keeps its state under <root>/<uid>.<gid>: the remap base.
        tail = Path(root).name
        uid, _, _gid = tail.partition(".")
        base = int(uid) if uid.isdigit() else -1
    runtimes = info.get("Runtimes")
    return DaemonFacts(
        version=str(version.get("Version") or info.get("ServerVersion") or "?"),
        api_version=str(version.get("ApiVersion") or "?"),
        runtimes=tuple(sorted(str(k) for k in runtimes)) if isinstance(runtimes, dict) else (),
        apparmor="apparmor" in names,
        seccomp="seccomp" in names,
        remap_base=base,
        root_dir=root,
    )


def nano_cpus(cpus: float) -> int:
    """CPU quota in 1e-9 CPUs; the Engine refuses more CPUs than the host has, so clamp."""
    return int(min(cpus, float(os.cpu_count() or 1)) * 1e9)


def docker_runtime(spec: SandboxSpec) -> str:
    """The daemon runtime for ``spec``: runc, or runsc (network off at runsc level, see
    docs/reference/docker-backend.md), with host unix sockets only when there is a gateway."""
    if spec.runtime == "runsc" and spec.gateway_dir is not None:
        return RUNSC_GATEWAY_RUNTIME
    return spec.runtime


def seccomp_json(settings: Settings, runtime: str) -> str:
    """agentbox's profile (the same file podman uses), as the Engine takes it: inline."""
    path = profile_path(settings.cache_dir, allow_clone3=runtime == "runsc")
    return json.dumps(json.loads(path.read_text()), separators=(",", ":"))


def main_argv(spec: SandboxSpec) -> list[str]:
    """The idle main process: its lifetime is the deadline plus :data:`DEADLINE_GRACE`.

    runc: ``sleep``. runsc: the spawner commands are started from (see _spawn.py), so
    they inherit the seccomp filter gVisor applies to the init's descendants only.
    """
    life = str(math.ceil(spec.deadline) + DEADLINE_GRACE)
    if spec.runtime == "runsc":
        return ["python3", "-I", "-S", "-c", SPAWNER, life]
    return ["sleep", life]


def exec_argv(spec: SandboxSpec, argv: list[str]) -> list[str]:
    """What ``docker exec`` runs for ``argv``: itself (runc), or through the spawner (runsc)."""
    if spec.runtime == "runsc":
        return ["python3", "-I", "-S", "-c", CLIENT, "--", *argv]
    return argv


#: The Engine's default masked paths plus what podman masks beside them: ``/sys/dev/block``
#: (the host's block devices by number) and powercap (energy counters). Setting the
#: list replaces the Engine's, so its defaults are repeated here.
MASKED_PATHS: tuple[str, ...] = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/dev/block", "/sys/devices/virtual/powercap",
)  # fmt: skip
#: The Engine's default read-only paths (repeated: setting the list replaces them).
_READONLY_DEFAULT = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def cgroup_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> tuple[str, ...]:
    """The host's cgroup mounts under ``/sys/fs/cgroup`` (v1: one per hierarchy; v2: the
    one): the targets a sandbox's own cgroup namespace mounts at the same paths."""
    out = []
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return ("/sys/fs/cgroup",)
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) > 4 and r and r[0] in ("cgroup", "cgroup2"):
            target = f[4]
            if target == "/sys/fs/cgroup" or target.startswith("/sys/fs/cgroup/"):
                out.append(target)
    return tuple(sorted(set(out))) or ("/sys/fs/cgroup",)


def readonly_paths() -> list[str]:
    """The Engine's read-only paths plus every cgroup hierarchy. A daemon with user
    namespace remapping clears the read-only flag of the cgroup v1 mounts it makes
    (podman keeps them ro): runc bind-remounts each of these read-only over them."""
    return [*_READONLY_DEFAULT, *cgroup_hierarchies()]


def _bind(source: Path, target: str, read_only: bool) -> dict[str, Any]:
    return {
        "Type": "bind",
        "Source": str(source),
        "Target": target,
        "ReadOnly": read_only,
        "BindOptions": {"Propagation": "rprivate", "NonRecursive": True},
    }


def container_body(
    spec: SandboxSpec,
    settings: Settings,
    facts: DaemonFacts,
    image_id: str,
    *,
    unsafe_host_config: dict[str, Any] | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """The ``POST /containers/create`` body: an idle sandbox whose own clock ends it.

    The main process is ``sleep`` for the deadline plus :data:`DEADLINE_GRACE` under
    tini (``Init``): when it ends, the container's pid namespace dies with every
    process in it, even if agentbox is gone. Commands are exec'd into it.
    ``command``: a detached sandbox's own main command instead (see _detach.py).
    """
    res = spec.resources
    mem = int(res.memory)
    security = [
        "no-new-privileges",
        # podman's default profile minus user namespaces, socket families, AIO, keyctl.
        f"seccomp={seccomp_json(settings, spec.runtime)}",
    ]
    if facts.apparmor:
        security.append("apparmor=docker-default")
    mounts = []
    if spec.workspace is not None:
        mounts.append(_bind(spec.workspace, WORKSPACE_IN_SANDBOX, False))
    if spec.gateway_dir is not None:
        mounts.append(_bind(spec.gateway_dir, GATEWAY_DIR_IN_SANDBOX, False))
    mounts += [_bind(m.source, m.target, m.read_only) for m in spec.mounts]
    ulimits = [
        {"Name": "nofile", "Soft": res.nofile, "Hard": res.nofile},
        {"Name": "nproc", "Soft": res.pids, "Hard": res.pids},
        *({"Name": k, "Soft": v, "Hard": v} for k, v in sorted(SANDBOX_RLIMITS.items())),
    ]
    host_config: dict[str, Any] = {
        "NetworkMode": "none",               # only lo
        "ReadonlyRootfs": True,              # read-only root filesystem
        "CapDrop": ["ALL"],
        "CapAdd": [],
        "SecurityOpt": security,
        "IpcMode": "private",
        "CgroupnsMode": "private",           # its own cgroup tree, not the host's (v1)
        "ReadonlyPaths": readonly_paths(),   # cgroup hierarchies ro, as podman's
        "MaskedPaths": list(MASKED_PATHS),   # /sys/dev/block too, as podman's
        # Not the Engine's Init: it bind-mounts /usr/sbin/docker-init, an undeclared mount
        # (the escape suite's fs.declared_mounts_only). The image's own tini is PID 1.
        "Init": False,
        "PidsLimit": res.pids,
        "Memory": mem,
        "MemorySwap": mem,                   # equal to memory: no swap
        "NanoCpus": nano_cpus(res.cpus),    # 4, or all the host has if fewer
        "Ulimits": ulimits,
        "Tmpfs": {
            "/tmp": "rw,nosuid,nodev,mode=1777",
            HOME_IN_SANDBOX: "rw,nosuid,nodev,mode=1777",
        },
        "Mounts": mounts,                    # exactly the declared ones, nothing else
        "Runtime": docker_runtime(spec),
        "AutoRemove": False,                 # removed by us (and the orphan sweep)
        "RestartPolicy": {"Name": "no"},
        "Privileged": False,
        "PublishAllPorts": False,
    }  # fmt: skip
    if unsafe_host_config:
        host_config.update(unsafe_host_config)
    labels = {
        LABEL: "1",
        **spec.labels,
        "io.agentbox.owner-pid": str(os.getpid()),
        "io.agentbox.runtime": spec.runtime,
        "io.agentbox.backend": "docker",
    }
    return {
        "Image": image_id,
        "Entrypoint": [TINI, "--"],  # tini as PID 1: reaps, forwards signals
        "Cmd": command if command is not None else entry_argv(spec, main_argv(spec)),
        "User": f"{spec.uid}:{spec.uid}",
        "WorkingDir": spec.workdir,
        "Env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
        "Labels": labels,
        "NetworkDisabled": True,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "Tty": False,
        "OpenStdin": False,
        "HostConfig": host_config,
    }
