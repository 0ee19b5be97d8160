"""Run the escape suite on one backend/runtime: a real sandbox, probes inside, checks outside.

The sequence (one sandbox start for the real run):

1. the host plants its fixture (:class:`~agentbox.escape._fixtures.Fixture`);
2. the backend creates a sandbox with the workspace, the gateway dir and one
   read-only declared mount;
3. the probe program (:mod:`agentbox.guest.probe`, sent as ``python3 -c``: no
   copy needed, works on every backend) runs every inside probe and prints JSON,
   which is parsed defensively (it comes from the sandbox);
4. the host reads the sandbox's processes (every thread) for capabilities,
   no_new_privs, seccomp, uids, the uid map, namespaces and cgroup limits;
5. the sandbox fork-bombs itself while the host measures its own latency;
6. the sandbox is destroyed, the fixture removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from agentbox._log import get_logger
from agentbox.backends.base import Backend, BindMount, Sandbox, SandboxSpec
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.errors import AgentboxError, SandboxError, UnsupportedError
from agentbox.escape import _hostcheck as hc
from agentbox.escape._fixtures import RO_TARGET, Fixture
from agentbox.escape._model import Outcome, ProbeSpec, Status
from agentbox.escape._quota import KINDS, QuotaWatcher, exhaust_config
from agentbox.escape._registry import PROBES

#: Where a microVM gets the suite's declared mount (its root is read-only).
VM_RO_TARGET = "/home/agent/declared"

__all__ = [
    "FORKBOMB_TARGET",
    "LATENCY_LIMIT",
    "HostView",
    "host_outcomes",
    "inside_outcomes",
    "probe_source",
    "quota_outcomes",
    "run_probe_program",
    "run_real",
    "sandbox_pids",
]

log = get_logger("escape")

#: Children the fork bomb tries to make: well above the default pids limit (512).
FORKBOMB_TARGET = 900
#: Largest oversleep (seconds) of a 5 ms host sleep loop we accept during the fork bomb.
LATENCY_LIMIT = 0.5
#: The limits the real sandbox is given (small memory: the suite needs little).
SUITE_RESOURCES = Resources(cpus=1.0, memory=512 * 1024**2, pids=512, nofile=4096)


def probe_source() -> str:
    """The in-sandbox probe program's source text."""
    return resources.files("agentbox.guest").joinpath("probe.py").read_text()


class _Execs(Protocol):
    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Any = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_stdout: Any = None,
        on_stderr: Any = None,
    ) -> Any: ...


def _parse_json(raw: bytes, what: str) -> dict[str, Any]:
    """The last JSON object line of ``raw`` (untrusted: bounded, shape-checked)."""
    text = raw[-4 * 1024 * 1024 :].decode(errors="replace")
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict):
                return data
    raise SandboxError(f"{what}: no JSON in its output: {text[-300:]!r}")


def run_probe_program(
    box: _Execs, config: dict[str, object], args: Sequence[str] = (), timeout: float = 240.0
) -> dict[str, Any]:
    """Run the probe program in ``box`` with ``config`` on stdin; return its parsed JSON."""
    res = box.exec(
        ["python3", "-I", "-S", "-c", probe_source(), *args],
        stdin=json.dumps(config).encode(),
        timeout=timeout,
    )
    if getattr(res, "timed_out", False):
        raise SandboxError(f"the probe program timed out after {timeout:g}s")
    return _parse_json(res.stdout, f"probe program (exit {res.exit_code}, {res.stderr[-300:]!r})")


def _outcome(spec: ProbeSpec, status: Status, seen: str) -> Outcome:
    return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)


def inside_outcomes(data: dict[str, Any], *, vm: bool = False) -> list[Outcome]:
    """Turn the probe program's JSON into outcomes; a probe it did not answer is an error.

    On a microVM (``vm``), probes of a shared kernel's surface are n/a: what they
    read is the guest's own kernel. What they saw is still reported.
    """
    results = data.get("results")
    results = results if isinstance(results, dict) else {}
    out = []
    for spec in PROBES:
        if spec.where != "inside":
            continue
        r = results.get(spec.id)
        if not isinstance(r, dict) or "ok" not in r:
            out.append(_outcome(spec, "error", "the probe program gave no answer"))
            continue
        ok, seen = r.get("ok"), str(r.get("seen", ""))
        status: Status = "n/a" if ok is None else "pass" if ok is True else "fail"
        if r.get("error"):
            status = "error"
        if vm and spec.applies == "container":
            status, seen = "n/a", f"microVM: the guest's own kernel (saw: {seen})"
        out.append(_outcome(spec, status, seen))
    return out


def sandbox_pids(box: Sandbox) -> list[int]:
    """Host pids of every process of ``box`` (:meth:`~agentbox.backends.base.Sandbox.host_pids`:
    a container's init and the rest of its cgroup, a microVM's VMM)."""
    return sorted({int(p) for p in box.host_pids()})


class HostView:
    """What the host expects of a sandbox's processes, per backend/runtime."""

    def __init__(
        self,
        *,
        runtime: str,
        mapped_uid: int,
        pids_max: int,
        memory: int,
        vm: bool = False,
        isolation: str = "standard",
    ) -> None:
        self.vm = vm
        self.isolation = isolation
        self.runtime = runtime
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
        elif view.runtime == "runsc":
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
        if view.runtime == "runsc" and kind in ("pid", "cgroup") and not own:
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


def forkbomb_outcomes(
    box: _Execs, view: HostView, init_pid: int = 0, target: int = FORKBOMB_TARGET
) -> list[Outcome]:
    """Fork-bomb inside while a host thread measures its own latency and the cgroup's pids.

    Contained means: the host never counted more than the limit in the sandbox's
    cgroup and the bomb did not get all it asked for. Under gVisor the Sentry's
    own threads count against the same limit, so the bomb can take the sandbox
    down with it; that is containment too (the host is unaffected), and is said.
    """
    specs = {p.id: p for p in PROBES}
    meter = hc.LatencyMeter(cgroup=hc.cgroup_dir(init_pid, "pids") if init_pid else None)
    meter.start()
    err = ""
    data: dict[str, Any] = {}
    try:
        data = run_probe_program(box, {}, ["--forkbomb", str(target), "--hold", "3"], 120)
    except AgentboxError as exc:
        err = str(exc)
    finally:
        meter.stop()
    fb = data.get("forkbomb") if isinstance(data.get("forkbomb"), dict) else None
    out = []
    peak = f"host saw at most {meter.peak_pids} pids in its cgroup" if meter.peak_pids else ""
    under = 0 < meter.peak_pids <= view.pids_max
    spec = specs["host.forkbomb_contained"]
    if view.vm and fb is not None:
        # The guest's processes live in the guest kernel: what counts is the VMM on the host.
        seen = f"guest forked {fb.get('forked')}/{target} in its own kernel; {peak}"
        out.append(_outcome(spec, "pass" if under else "fail", seen))
    elif fb is None:
        # No answer: the sandbox died under the bomb. Contained only if the host saw the cap.
        seen = f"the sandbox died under the bomb ({err[:160]}); {peak or 'no pids read'}"
        out.append(_outcome(spec, "pass" if under else "error", seen))
    else:
        forked = int(fb.get("forked", 0))
        ok = forked < target and forked <= view.pids_max and (under or not meter.peak_pids)
        seen = f"forked {forked}/{target} children, then {fb.get('error') or 'no error'}; {peak}"
        out.append(_outcome(spec, "pass" if ok else "fail", seen))
    out.append(latency_outcome(meter))
    return out


#: How long the sandbox holds a spent counter while root tries to spend one.
QUOTA_HOLD = 1.5


def quota_outcomes(box: _Execs, view: HostView) -> list[Outcome]:
    """For each per-user kernel counter: the sandbox spends it until refused and holds it,

    while a thread of this (root) process keeps trying to spend one unit. Confinement
    holds when root was never refused. On a microVM the guest's kernel charges its own
    counters, so these are n/a (said so, without running).
    """
    specs = {p.id: p for p in PROBES}
    out = []
    for kind, pid in KINDS.items():
        spec = specs[pid]
        if view.vm:
            out.append(_outcome(spec, "n/a", "microVM: the guest kernel charges its own "
                                "counters; none reaches the host's root quota"))  # fmt: skip
            continue
        watcher = QuotaWatcher(kind)
        watcher.start()
        got: dict[str, Any] | None = None
        err = ""
        try:
            args = ["--exhaust", kind, "--hold", f"{QUOTA_HOLD}"]
            data = run_probe_program(box, exhaust_config(kind), args, 120)
            got = data.get("exhaust") if isinstance(data.get("exhaust"), dict) else None
        except AgentboxError as exc:
            err = str(exc)[:200]
        finally:
            watcher.stop()
        took = (
            f"sandbox took {got.get('took')} ({got.get('errno') or 'not refused'})" if got else ""
        )
        root = f"root tried {watcher.tries}x, refused {watcher.refused}x"
        root += f" ({watcher.first_error})" if watcher.first_error else ""
        status: Status
        if watcher.refused:
            status, seen = "fail", f"{took}; {root}: the sandbox spent root's quota"
        elif got is None or watcher.tries == 0:
            status, seen = "error", f"no answer from the sandbox ({err}); {root}"
        else:
            status, seen = "pass", f"{took}; {root}"
        if view.runtime == "runsc" and status == "pass":
            seen += "; gVisor: the Sentry's own counter"
        out.append(_outcome(spec, status, seen))
    return out


def latency_outcome(meter: hc.LatencyMeter) -> Outcome:
    """The host's worst oversleep against :data:`LATENCY_LIMIT`."""
    spec = next(p for p in PROBES if p.id == "host.forkbomb_latency")
    ok = bool(meter.samples) and meter.worst < LATENCY_LIMIT
    seen = (
        f"{len(meter.samples)} samples of a 5 ms sleep: worst +{meter.worst * 1000:.0f} ms, "
        f"p99 +{meter.p99 * 1000:.0f} ms (limit {LATENCY_LIMIT * 1000:.0f} ms)"
    )
    return _outcome(spec, "pass" if ok else "fail", seen)


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


def real_spec(
    fx: Fixture, settings: Settings, image: str, runtime: str, isolation: str
) -> SandboxSpec:
    """The sandbox the real run uses: workspace, gateway dir, one read-only declared mount."""
    return SandboxSpec(
        name=f"agentbox-escape-{fx.marker_nonce[-12:]}",
        image=image,
        runtime=runtime,  # type: ignore[arg-type]
        isolation=isolation,  # type: ignore[arg-type]
        resources=SUITE_RESOURCES,
        mounts=(BindMount(fx.ro_dir, RO_TARGET, read_only=True),),
        workspace=fx.workspace,
        gateway_dir=fx.gateway_dir,
        deadline=600.0,
        uid=settings.sandbox_uid,
    )


def vmm_uid(settings: Settings, isolation: str) -> int:
    """The host uid a microVM's VMM runs as: not yours under strict, yours under standard."""
    with contextlib.suppress(ImportError):
        from agentbox.backends.qemu import vmm_uid as qemu_vmm_uid

        return qemu_vmm_uid(settings, "strict" if isolation == "strict" else "standard")
    if isolation == "strict":
        return settings.subid_base + 65536 + 1
    return os.getuid()


def run_real(
    backend: Backend,
    settings: Settings,
    fx: Fixture,
    *,
    image: str,
    runtime: str,
    isolation: str,
    during: Callable[[Sandbox], list[Outcome]] | None = None,
) -> tuple[list[Outcome], list[Outcome], dict[str, object]]:
    """Start one real sandbox, run every probe, destroy it.

    ``during`` runs against the live sandbox after the probes (the exec-level
    controls); returns (outcomes, what ``during`` returned, facts).
    """
    spec = real_spec(fx, settings, image, runtime, isolation)
    try:
        backend.check(spec)
    except (UnsupportedError, SandboxError) as exc:
        if "mount" not in str(exc):
            raise
        # A microVM's root is a read-only disk: /opt/declared does not exist there, so
        # qemu gets its declared mount on the guest's tmpfs $HOME instead.
        spec = spec.replace(mounts=(BindMount(fx.ro_dir, VM_RO_TARGET, read_only=True),))
        try:
            backend.check(spec)
        except UnsupportedError as exc2:
            # A backend without declared mounts (firecracker) gets none; the
            # read-only-mount probes then say n/a, explicitly.
            if "mount" not in str(exc2):
                raise
            spec = spec.replace(mounts=())
            backend.check(spec)
    facts: dict[str, object] = {"sandbox": spec.name, "fixture_root": str(fx.root)}
    vm = backend.kind == "microvm"
    view = HostView(
        runtime=runtime,
        mapped_uid=vmm_uid(settings, isolation) if vm else settings.sandbox_host_uid,
        pids_max=spec.resources.pids,
        # A VMM's cgroup holds the guest's RAM plus QEMU itself: allow 1 GiB over.
        memory=spec.resources.memory + (1024**3 if vm else 0),
        vm=vm,
        isolation=isolation,
    )
    cfg = fx.probe_config(uid=spec.uid, pids_max=spec.resources.pids, runtime=runtime)
    cfg["disk"] = spec.resources.disk_limit(settings).model_dump()
    if not spec.mounts:
        cfg["ro_mount"] = None
    elif spec.mounts[0].target != RO_TARGET:
        cfg["ro_mount"] = spec.mounts[0].target
        cfg["allowed_mounts"] = [*cfg["allowed_mounts"], spec.mounts[0].target]  # type: ignore[misc]
    # 1. The agent's own path: the probe is the sandbox's main command (backend.run), exactly
    #    as the launcher runs claude. These are the inside results that count.
    t0 = time.monotonic()
    # The config rides in the environment: stdin would be a host file passed through.
    res = backend.run(
        spec.replace(name=spec.name + "-run", env={"ABX_PROBE_CONFIG": json.dumps(cfg)}),
        ["python3", "-I", "-S", "-c", probe_source()],
    )
    data = _parse_json(res.stdout, f"probe program as main command (exit {res.exit_code})")
    facts["run_seconds"] = round(time.monotonic() - t0, 2)
    facts["kernel_inside"] = str(data.get("kernel", "?"))[:80]
    facts["probe_seconds"] = data.get("seconds")
    outcomes = inside_outcomes(data, vm=vm)
    # 2. A long-lived sandbox of the same spec: host-side checks, exec'd probes, fork bomb.
    t0 = time.monotonic()
    box = backend.create(spec)
    facts["start_seconds"] = round(time.monotonic() - t0, 2)
    try:
        # The same probes exec'd in (how `agentbox smoke` and copy_in/out reach a sandbox):
        # differences from the main-command path are reported as facts, not verdicts.
        via_exec = {o.id: o for o in inside_outcomes(run_probe_program(box, cfg), vm=vm)}
        facts["exec_path_differences"] = {
            o.id: f"{o.status} as main command, {via_exec[o.id].status} via exec: "
            f"{via_exec[o.id].seen[:120]}"
            for o in outcomes
            if o.id in via_exec and via_exec[o.id].status != o.status
        }
        pids = sandbox_pids(box)
        facts["host_pids"] = len(pids)
        outcomes += host_outcomes(pids, view)
        outcomes.append(kernel_outcome(box, runtime, backend.shares_host_kernel(runtime)))
        outcomes += quota_outcomes(box, view)
        # The egress proxy, asked from inside for inner targets (its socket in the gateway dir).
        from agentbox.egress import escape_outcome

        outcomes.append(escape_outcome(box, fx.gateway_dir, settings=settings, vm=vm))
        # The task's gateway, spawned as run_task spawns it (its posture, not the sandbox's).
        from agentbox.escape._gateway import gateway_outcomes

        outcomes += gateway_outcomes(settings)
        # Before the fork bomb: under gVisor the bomb may take the sandbox down.
        extra = during(box) if during is not None else []
        outcomes += forkbomb_outcomes(box, view, pids[0] if pids else 0)
    finally:
        box.destroy()
    order = {p.id: i for i, p in enumerate(PROBES)}
    outcomes.sort(key=lambda o: order.get(o.id, 999))
    return outcomes, extra, facts
