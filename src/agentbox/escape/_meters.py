"""Resource meters: the fork bomb against the host's latency, the kernel quota counters."""

from __future__ import annotations

from typing import Any

from agentbox.errors import AgentboxError
from agentbox.escape import _hostcheck as hc
from agentbox.escape._hostview import HostView
from agentbox.escape._model import Outcome, Status
from agentbox.escape._probeio import (
    _Execs,
    _outcome,
    run_probe_program,
)
from agentbox.escape._quota import KINDS, QuotaWatcher, exhaust_config
from agentbox.escape._registry import PROBES

#: Children the fork bomb tries to make: well above the default pids limit (512).
FORKBOMB_TARGET = 900
#: Largest oversleep (seconds) of a 5 ms host sleep loop we accept during the fork bomb.
LATENCY_LIMIT = 0.5


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
        if view.own_kernel and status == "pass":
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
