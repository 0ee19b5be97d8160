"""Reading a live podman sandbox's posture: from inside it and from the host.

Inside, a small stdlib-only probe (run as the sandbox uid through ``podman
exec``) reports ids, capability sets, no_new_privs and the seccomp mode (via
``prctl``, which gVisor answers too), network interfaces, kernel and mounts.
Its output is untrusted: parsed as bounded JSON and only compared.

From the host, ``podman inspect`` gives the configuration and ``/proc`` gives
the truth: every process of the container's cgroup, every thread of each, is
read for its uids, capabilities, ``NoNewPrivs`` and ``Seccomp``, and the init
process's ``uid_map`` and namespaces are compared with the host's.

Under gVisor (runsc) the workload's ids live in gVisor's own kernel: the host
runs the sentry as ``nobody`` (65534) in a user namespace of its own and the
gofer as the mapped container root (``subid_base``); both hold no_new_privs
and a seccomp filter. Those are the host checks for runsc; host uid
``subid_base + 64000`` is a runc/crun fact.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.backends._uidslots import slot_base, slot_of
from agentbox.backends.base import (
    GATEWAY_DIR_IN_SANDBOX,
    GATEWAY_PORT,
    HOME_IN_SANDBOX,
    WORKSPACE_IN_SANDBOX,
    Posture,
    PostureCheck,
    Sandbox,
    SandboxSpec,
)
from agentbox.backends.oci._sandbox import wait_relay_inside
from agentbox.backends.oci._userns_limits import SANDBOX_CAPS, SANDBOX_RLIMITS
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import CommandError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.podman._sandbox import PodmanSandbox

#: Runs inside the sandbox (``python3 -I -S -c PROBE``); prints one JSON object.
PROBE = r"""
import ctypes, json, os
st = {}
for line in open("/proc/self/status"):
    k, _, v = line.partition(":")
    st[k] = v.strip()
libc = ctypes.CDLL(None, use_errno=True)
mounts = []
for line in open("/proc/self/mountinfo"):
    pre, _, post = line.partition(" - ")
    f = pre.split()
    point = f[4].encode().decode("unicode_escape")
    mounts.append([point, f[5], post.split()[0] if post else ""])
ifaces = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
userns = {}
if os.path.isdir("/proc/sys/user"):
    for n in sorted(os.listdir("/proc/sys/user")):
        try:
            userns[n] = int(open("/proc/sys/user/" + n).read())
        except (OSError, ValueError):
            pass
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "status": {k: st.get(k) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                      "NoNewPrivs", "Seccomp")},
    "nnp": libc.prctl(39, 0, 0, 0, 0), "seccomp": libc.prctl(21, 0, 0, 0, 0),
    "ifaces": ifaces, "mounts": mounts, "kernel": os.uname().release, "userns": userns,
}))
"""

#: Mount points every container has (the runtime's own); anything else must be declared.
_SYSTEM_MOUNTS = frozenset({"/", "/etc/hostname", "/run/.containerenv", "/run/podman-init"})
_SYSTEM_PREFIXES = ("/proc", "/sys", "/dev")
NAMESPACES = ("user", "net", "ipc", "pid", "mnt")


def expected_mounts(spec: SandboxSpec) -> set[str]:
    """The data mounts the sandbox must have, no more: workspace, gateway dir, declared."""
    want = {m.target for m in spec.mounts}
    if spec.workspace is not None:
        want.add(WORKSPACE_IN_SANDBOX)
    if spec.gateway_dir is not None:
        want.add(GATEWAY_DIR_IN_SANDBOX)
    return want


def _is_system(point: str) -> bool:
    return point in _SYSTEM_MOUNTS or any(
        point == p or point.startswith(p + "/") for p in _SYSTEM_PREFIXES
    )


def _status(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(":")
            out[k] = v.strip()
    except OSError:
        pass
    return out


def _cgroup_procs(pid: int) -> list[int]:
    """Every pid in the cgroup of ``pid`` (v1: the pids controller; v2: the unified one)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    rel = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            rel = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            break
        if controllers == "" and rel is None:
            rel = Path("/sys/fs/cgroup") / path.lstrip("/")
    if rel is None:
        return [pid]
    try:
        return [int(x) for x in (rel / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return [pid]


def host_processes(init_pid: int) -> list[tuple[int, int, dict[str, str]]]:
    """``(pid, tid, status)`` of every thread of every process in the container's cgroup."""
    out = []
    for pid in _cgroup_procs(init_pid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            st = _status(Path(f"/proc/{pid}/task/{tid}/status"))
            if st:
                out.append((pid, tid, st))
    return out


def _inspect(name: str) -> dict[str, Any]:
    try:
        res = _proc.run(["podman", "inspect", "--type", "container", name], timeout=60)
        data = json.loads(res.stdout)
    except (CommandError, json.JSONDecodeError) as exc:
        raise SandboxError(f"cannot inspect: {exc}", sandbox=name) from exc
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise SandboxError("podman inspect gave no container", sandbox=name)
    return data[0]


def probe_inside(box: Sandbox) -> dict[str, Any]:
    """Run :data:`PROBE` in ``box`` as its uid; its output parsed as bounded JSON."""
    res = box.exec(["python3", "-I", "-S", "-c", PROBE], timeout=60)
    if res.exit_code != 0 or len(res.stdout) > 1_000_000:
        raise SandboxError(
            f"posture probe failed (exit {res.exit_code}): "
            f"{res.stderr.decode(errors='replace')[-400:]}",
            sandbox=box.name,
        )
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise SandboxError(f"posture probe printed no JSON: {exc}", sandbox=box.name) from exc
    if not isinstance(data, dict):
        raise SandboxError("posture probe printed no object", sandbox=box.name)
    return data


def _check(
    name: str, expected: object, seen: object, ok: bool | None = None, where: str = "inside"
) -> PostureCheck:
    e, s = str(expected), str(seen)
    return PostureCheck(name, e, s, (e == s) if ok is None else ok, where)  # type: ignore[arg-type]


def _inside_checks(spec: SandboxSpec, d: dict[str, Any]) -> list[PostureCheck]:
    st = d.get("status") if isinstance(d.get("status"), dict) else {}
    assert isinstance(st, dict)
    mounts = [m for m in d.get("mounts", []) if isinstance(m, list) and len(m) == 3]
    by_point = {str(m[0]): (str(m[1]), str(m[2])) for m in mounts}
    data_points = {p for p in by_point if not _is_system(p)}
    want = expected_mounts(spec) | {"/tmp", HOME_IN_SANDBOX}
    ifaces = sorted(str(x) for x in d.get("ifaces", []))
    gvisor = spec.runtime == "runsc"
    checks = [
        _check("uid", spec.uid, d.get("uid")),
        _check("gid", spec.uid, d.get("gid")),
        _check("CapEff", "0000000000000000", st.get("CapEff")),
        _check("CapBnd", "0000000000000000", st.get("CapBnd")),
        _check("CapPrm", "0000000000000000", st.get("CapPrm")),
        _check("NoNewPrivs", 1, d.get("nnp")),
        _check("network interfaces", ["lo"], ifaces),
        _check("root read-only", "ro", by_point.get("/", ("?", ""))[0].split(",")[0]),
        _check("mounts", sorted(want), sorted(data_points)),
        _check("/tmp, $HOME tmpfs", "tmpfs tmpfs", " ".join(
            by_point.get(p, ("", "-"))[1] for p in ("/tmp", HOME_IN_SANDBOX))),
    ]  # fmt: skip
    if not gvisor:  # gVisor's /proc does not report the ambient set
        checks.append(_check("CapAmb", "0000000000000000", st.get("CapAmb")))
    if gvisor:
        host_kernel = os.uname().release
        kern = str(d.get("kernel"))
        checks.append(
            _check("kernel (gVisor's own)", f"not {host_kernel}", kern, kern != host_kernel)
        )
    else:
        # gVisor's prctl reports 0 for the sentry-enforced OCI filter; the host check covers it.
        checks.append(_check("Seccomp", 2, d.get("seccomp")))
        weak = sorted(
            p
            for p in expected_mounts(spec)
            if p in by_point and not {"nosuid", "nodev"} <= set(by_point[p][0].split(","))
        )
        checks.append(_check("data mounts nosuid,nodev", [], weak))
        # The per-user counters the kernel also charges to root (the namespace's owner).
        seen = d.get("userns") if isinstance(d.get("userns"), dict) else {}
        assert isinstance(seen, dict)
        over = sorted(
            f"{k}={seen.get(k)}" for k, cap in SANDBOX_CAPS.items() if k in seen and seen[k] != cap
        )
        checks.append(
            _check("user namespace caps (/proc/sys/user)", [], over, not over and bool(seen))
        )
    for m in spec.mounts:
        opts = by_point.get(m.target, ("missing", ""))[0]
        checks.append(_check(f"{m.target} read-only", "ro", opts.split(",")[0]))
    return checks


def _ns(pid: int | str, kind: str) -> str:
    try:
        return str(Path(f"/proc/{pid}/ns/{kind}").readlink())
    except OSError:
        return "?"


def all_same(values: Iterable[str]) -> str:
    """The one value all of ``values`` hold, else them all (comma-separated), or "none"."""
    vals = sorted(set(values))
    return vals[0] if len(vals) == 1 else ",".join(vals) or "none"


def process_checks(
    pid: int, kinds: Iterable[str]
) -> tuple[list[PostureCheck], list[tuple[int, int, dict[str, str]]]]:
    """From ``/proc``: each of ``kinds`` namespaces of init ``pid`` is not ours, then
    every thread of its cgroup is read (``NoNewPrivs`` 1, ``Seccomp`` 2); the threads too."""
    checks = []
    for kind in kinds:
        theirs, ours = _ns(pid, kind), _ns("self", kind)
        own = "?" not in (theirs, ours) and theirs != ours
        checks.append(_check(f"{kind} namespace", "not the host's", theirs, own, where="host"))
    threads = host_processes(pid)
    nnp = all_same(st.get("NoNewPrivs", "?") for _, _, st in threads)
    sec = all_same(st.get("Seccomp", "?") for _, _, st in threads)
    checks.append(_check("threads read", ">0", len(threads), bool(threads), where="host"))
    checks.append(_check("NoNewPrivs (every thread)", "1", nnp, where="host"))
    checks.append(_check("Seccomp (every thread)", "2", sec, where="host"))
    return checks, threads


def _host_checks(spec: SandboxSpec, settings: Settings, info: dict[str, Any]) -> list[PostureCheck]:
    hc = info.get("HostConfig") or {}
    res = spec.resources
    # The range the sandbox holds: its own slot's (a pooled sandbox's, handed to the task
    # at claim, is the one recorded under its name), else the settings' range.
    held = slot_of(settings, spec.name)
    base = settings.sandbox_subid_base if held is None else slot_base(settings, held)
    ulimits = {u.get("Name"): (u.get("Soft"), u.get("Hard")) for u in hc.get("Ulimits") or []}
    mounts = sorted(str(m.get("Destination")) for m in info.get("Mounts") or [])
    checks = [
        _check("runtime", spec.runtime, info.get("OCIRuntime"), where="host"),
        _check("NetworkMode", "none", hc.get("NetworkMode"), where="host"),
        _check("ReadonlyRootfs", True, hc.get("ReadonlyRootfs"), where="host"),
        _check("CapAdd", [], hc.get("CapAdd") or [], where="host"),
        _check("no-new-privileges", True,
               "no-new-privileges" in (hc.get("SecurityOpt") or []), where="host"),
        _check("PidsLimit", res.pids, hc.get("PidsLimit"), where="host"),
        _check("Memory = MemorySwap", res.memory,
               hc.get("Memory") if hc.get("Memory") == hc.get("MemorySwap") else "swap allowed",
               where="host"),
        _check("nofile", (res.nofile, res.nofile), ulimits.get("RLIMIT_NOFILE"), where="host"),
        *(
            _check(k, (v, v), ulimits.get(f"RLIMIT_{k.upper()}"), where="host")
            for k, v in sorted(SANDBOX_RLIMITS.items())
        ),
        _check("uid map", [f"0:{base}:65536"],
               (hc.get("IDMappings") or {}).get("UidMap"), where="host"),
        _check("mounts (inspect)", sorted(expected_mounts(spec)), mounts, where="host"),
    ]  # fmt: skip
    pid = int((info.get("State") or {}).get("Pid") or 0)
    if pid <= 0:
        checks.append(_check("container process", "running", "not running", where="host"))
        return checks
    # runsc: the sentry stays in the host's pid namespace; gVisor's kernel has its own pids.
    kinds = ("user", "net", "ipc", "mnt") if spec.runtime == "runsc" else NAMESPACES
    procs, threads = process_checks(pid, kinds)
    checks += procs
    uids = all_same(st.get("Uid", "?") for _, _, st in threads)
    if spec.runtime == "runsc":
        # The sentry runs as nobody in a userns of its own; the gofer as the mapped root.
        allowed = {65534, base}
        seen_uids = {
            int(x) for _, _, st in threads for x in st.get("Uid", "0").split() if x.isdigit()
        }
        checks.append(_check("host uids (sentry, gofer)", sorted(allowed), sorted(seen_uids),
                             bool(seen_uids) and seen_uids <= allowed, where="host"))  # fmt: skip
    else:
        host_uid = base + spec.uid
        want = "\t".join([str(host_uid)] * 4)
        checks.append(_check("host uid (every thread)", want, uids, where="host"))
        caps = all_same(st.get("CapEff", "?") for _, _, st in threads)
        bnd = all_same(st.get("CapBnd", "?") for _, _, st in threads)
        checks.append(_check("CapEff (every thread)", "0000000000000000", caps, where="host"))
        checks.append(_check("CapBnd (every thread)", "0000000000000000", bnd, where="host"))
        try:
            umap = " ".join(Path(f"/proc/{pid}/uid_map").read_text().split())
        except OSError:
            umap = "?"
        checks.append(_check("uid_map", f"0 {base} 65536", umap, where="host"))
    return checks


def read_posture(box: PodmanSandbox, settings: Settings) -> Posture:
    """Inside and host checks of a running sandbox."""
    inside = probe_inside(box)
    info = _inspect(box.name)
    checks = _inside_checks(box.spec, inside) + _host_checks(box.spec, settings, info)
    return Posture("podman", box.spec.runtime, tuple(checks))


def wait_relay(box: PodmanSandbox, timeout: float = 10.0) -> None:
    """Return once the in-sandbox relay listens on 127.0.0.1:GATEWAY_PORT.

    runc/crun: read the container's ``/proc/<pid>/net/tcp`` from the host (no
    process started). runsc: its network stack is inside the sentry, so ask
    from inside.
    """
    if box.spec.runtime == "runsc":
        wait_relay_inside(box, timeout)
        return
    info = _inspect(box.name)
    pid = int((info.get("State") or {}).get("Pid") or 0)
    want = f"0100007F:{GATEWAY_PORT:04X}"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 3 and f[1] == want and f[3] == "0A":  # 0A = LISTEN
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise SandboxError("gateway relay did not start listening", sandbox=box.name)
