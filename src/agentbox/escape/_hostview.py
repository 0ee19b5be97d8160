"""What the host sees of a sandbox: its processes' credentials, maps, namespaces, limits, kernel."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from agentbox.backends.base import Sandbox
from agentbox.escape import _hostcheck as hc
from agentbox.escape._model import Outcome, Status
from agentbox.escape._probeio import (
    _Execs,
    _outcome,
)
from agentbox.escape._registry import PROBES


def sandbox_pids(box: Sandbox) -> list[int]:
    """Host pids of every process of ``box`` (:meth:`~agentbox.backends.base.Sandbox.host_pids`:
    a container's init and the rest of its cgroup, a microVM's VMM)."""
    return sorted({int(p) for p in box.host_pids()})


class HostView:
    """What the host expects of a sandbox's processes, per backend/runtime.

    Asked by trait, never by name: ``vm`` (the backend's ``kind`` is ``microvm``) and
    ``own_kernel`` (a container whose runtime brings its own kernel, its backend's
    ``shares_host_kernel(runtime)`` False: gVisor's Sentry). ``runtime`` is for the
    report only.
    """

    def __init__(
        self,
        *,
        runtime: str,
        mapped_uid: int,
        pids_max: int,
        memory: int,
        vm: bool = False,
        isolation: str = "standard",
        own_kernel: bool = False,
    ) -> None:
        self.vm = vm
        self.isolation = isolation
        self.runtime = runtime
        self.own_kernel = own_kernel and not vm
        self.mapped_uid = mapped_uid
        self.pids_max = pids_max
        self.memory = memory


def _in_host_userns(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/ns/user").readlink() == Path("/proc/self/ns/user").readlink()
    except OSError:
        return True  # unreadable: assume the worst


def host_outcomes(pids: list[int], view: HostView) -> list[Outcome]:
    """Read every thread of ``pids`` and the cgroup limits; one outcome per host probe."""
    specs = {p.id: p for p in PROBES if p.where == "host"}
    threads = hc.read_threads(pids)
    out: list[Outcome] = []

    def add(pid: str, ok: bool | None, seen: str) -> None:
        status: Status = "n/a" if ok is None else "pass" if ok else "fail"
        out.append(_outcome(specs[pid], status, seen))

    if not threads:
        for pid in (
            "host.caps_effective", "host.caps_bounding", "host.no_new_privs",
            "host.seccomp", "host.uid",
        ):  # fmt: skip
            add(pid, False, f"no readable thread among pids {pids}")
    else:
        n = len(threads)
        # Capabilities only matter where they are effective: in the host's user namespace.
        # gVisor's sentry and gofer hold some inside user namespaces of their own.
        host_ns = {t.pid: _in_host_userns(t.pid) for t in threads}
        eff = [t for t in threads if (t.cap_eff or t.cap_prm) and host_ns[t.pid]]
        in_own = sorted(
            {f"{t.name}:{t.cap_eff:#x}" for t in threads if t.cap_eff and not host_ns[t.pid]}
        )
        note = f"; in own user namespaces only: {in_own}" if in_own else ""
        add(
            "host.caps_effective",
            not eff,
            f"{len(eff)}/{n} threads with host capabilities"
            + (f" e.g. {eff[0].name}:{eff[0].cap_eff:#x}" if eff else "")
            + note,
        )
        bnd = [t for t in threads if t.cap_bnd and host_ns[t.pid]]
        add(
            "host.caps_bounding",
            not bnd,
            f"{len(bnd)}/{n} threads with a bounding set in the host user namespace"
            + (f" e.g. {bnd[0].name}:{bnd[0].cap_bnd:#x}" if bnd else ""),
        )
        nnp = [t for t in threads if t.no_new_privs != 1]
        add("host.no_new_privs", not nnp, f"{n - len(nnp)}/{n} threads NoNewPrivs=1")
        sec = [t for t in threads if t.seccomp != 2]
        add("host.seccomp", not sec, f"{n - len(sec)}/{n} threads Seccomp=2")
        me = {os.getuid(), int(os.environ.get("SUDO_UID", os.getuid()))}
        uids = sorted({u for t in threads for u in t.uids})
        bad = [u for u in uids if u == 0 or u in me]
        if view.vm and view.isolation != "strict":
            ok_uid: bool | None = None
            seen_uid = f"standard isolation runs the VMM as your uid by design: host uids {uids}"
        elif view.vm:
            ok_uid = not bad and uids == [view.mapped_uid]
            seen_uid = f"VMM host uids {uids} (want only {view.mapped_uid}, not 0/yours)"
        elif view.own_kernel:
            ok_uid = not bad
            seen_uid = f"host uids {uids} (want not 0/yours: gVisor's Sentry runs as nobody, "
            seen_uid += "its gofer as the mapped root)"
        else:
            ok_uid = not bad and uids == [view.mapped_uid]
            seen_uid = f"host uids {uids} (want only {view.mapped_uid})"
        add("host.uid", ok_uid, seen_uid)
    init = pids[0] if pids else 0
    add_uid_map(add, pids, view)
    for kind in ("net", "pid", "ipc", "uts", "user", "cgroup"):
        results = [hc.namespace_differs(p, kind) for p in pids]
        own = bool(results) and all(r[0] for r in results)
        seen = results[0][1] if results else "no process"
        if not own and results:
            seen = next(r[1] for r in results if not r[0])
        if view.vm and kind == "user" and not own:
            add("host.ns_user", None, "the VMM has no user namespace of its own: it runs as a "
                f"host uid with capabilities dropped ({seen}); see host.uid")  # fmt: skip
            continue
        if view.own_kernel and kind in ("pid", "cgroup") and not own:
            # The workload's pid and cgroup namespaces are the Sentry's own (emulated); the
            # Sentry and gofer processes themselves run in the host's, like a VMM does.
            add(f"host.ns_{kind}", None, f"gVisor: the workload's {kind} namespace is the "
                f"Sentry's own; the Sentry process is in the host's ({seen})")  # fmt: skip
            continue
        add(f"host.ns_{kind}", own, seen)
    add_limits(add, init, view)
    return out


def add_uid_map(
    add: Callable[[str, bool | None, str], None], pids: list[int], view: HostView
) -> None:
    """The uid map: no range may reach host uid 0, and (runc) the sandbox uid is the mapped one."""
    if view.vm and pids and not any(hc.namespace_differs(p, "user")[0] for p in pids):
        add("host.uid_map", None, "the VMM is in the host's user namespace (no map); see host.uid")
        return
    rows: list[str] = []
    ok = bool(pids)
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/uid_map").read_text().split("\n")
        except OSError:
            continue
        for line in text:
            f = line.split()
            if len(f) != 3:
                continue
            inside, outside, count = (int(x) for x in f)
            row = f"{inside}->{outside}x{count}"
            if row not in rows:
                rows.append(row)
            if outside == 0:
                ok = False
    add("host.uid_map", ok and bool(rows), "uid maps: " + ", ".join(rows[:6]))


def add_limits(add: Callable[[str, bool | None, str], None], init: int, view: HostView) -> None:
    """pids.max and the memory limit of the sandbox's cgroup, read from the host."""
    d = hc.cgroup_dir(init, "pids")
    val = ""
    with contextlib.suppress(OSError):
        if d is not None:
            val = (d / "pids.max").read_text().strip()
    ok = val.isdigit() and int(val) <= view.pids_max
    add("host.pids_limit", ok, f"pids.max={val or '?'} (want <= {view.pids_max}) in {d}")
    m = hc.cgroup_dir(init, "memory")
    mem = ""
    with contextlib.suppress(OSError):
        if m is not None:
            name = (
                "memory.limit_in_bytes" if (m / "memory.limit_in_bytes").exists() else "memory.max"
            )
            mem = (m / name).read_text().strip()
    okm = mem.isdigit() and int(mem) <= view.memory
    add("host.memory_limit", okm, f"memory limit={mem or '?'} (want <= {view.memory})")


def kernel_outcome(box: _Execs, runtime: str, shares_host_kernel: bool) -> Outcome:
    """Own kernel: release and boot id inside vs the host's (n/a on runc/crun: shared by design)."""
    spec = next(p for p in PROBES if p.id == "host.own_kernel")
    code = (
        "import os;print(os.uname().release);print(open('/proc/sys/kernel/random/boot_id').read())"
    )
    res = box.exec(["python3", "-I", "-S", "-c", code], timeout=30)
    lines = res.stdout.decode(errors="replace").split()
    rel, boot = [*lines, "?", "?"][:2]
    host_rel = os.uname().release
    host_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    differs = rel != host_rel and boot != host_boot
    seen = f"inside {rel} boot {boot[:8]}; host {host_rel} boot {host_boot[:8]}"
    if shares_host_kernel:
        return _outcome(spec, "n/a", f"container-only runtime shares the host kernel: {seen}")
    return _outcome(spec, "pass" if differs else "fail", seen)
