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
from collections.abc import Callable

from agentbox.backends.base import Backend, BindMount, Sandbox, SandboxSpec
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError, UnsupportedError
from agentbox.escape._fixtures import RO_TARGET, Fixture
from agentbox.escape._hostview import HostView, host_outcomes, kernel_outcome, sandbox_pids
from agentbox.escape._meters import (
    forkbomb_outcomes,
    quota_outcomes,
)
from agentbox.escape._model import Outcome
from agentbox.escape._probeio import (
    _parse_json as _parse_json,  # re-exported for _controls
)
from agentbox.escape._probeio import (
    inside_outcomes,
    probe_source,
    run_probe_program,
)
from agentbox.escape._registry import PROBES

#: Where a microVM gets the suite's declared mount (its root is read-only).
VM_RO_TARGET = "/home/agent/declared"

log = get_logger(__name__)

#: The limits the real sandbox is given (small memory: the suite needs little).
SUITE_RESOURCES = Resources(cpus=1.0, memory=512 * 1024**2, pids=512, nofile=4096)


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
        from agentbox.backends.microvm.qemu import vmm_uid as qemu_vmm_uid

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
        own_kernel=not backend.shares_host_kernel(runtime),
    )
    cfg = fx.probe_config(
        uid=spec.uid, pids_max=spec.resources.pids, runtime=runtime, own_kernel=view.own_kernel
    )
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
        from agentbox.escape._uidrange import neighbour_outcome

        outcomes.append(neighbour_outcome(backend, settings, spec, pids, vm=vm))
        outcomes.append(kernel_outcome(box, runtime, backend.shares_host_kernel(runtime)))
        outcomes += quota_outcomes(box, view)
        # The egress proxy, asked from inside for inner targets (its socket in the gateway dir).
        from agentbox.escape._egress import suite_outcome as escape_outcome

        outcomes.append(escape_outcome(box, fx.gateway_dir, settings=settings, vm=vm))
        # A rule's injected header: only its host's own requests carry it.
        from agentbox.escape._inject import PUSH_PROBE_ID
        from agentbox.escape._inject import suite_outcome as inject_outcome

        outcomes.append(inject_outcome(box, fx.gateway_dir, settings=settings, vm=vm))
        # [git] fetch's rules: a fetch gets through with the credential, a push never.
        outcomes.append(
            inject_outcome(box, fx.gateway_dir, settings=settings, vm=vm, probe=PUSH_PROBE_ID)
        )
        # A brokered secret held by a real proxy: nowhere inside (environ, cmdline, files).
        from agentbox.escape._secret import suite_outcome as secret_outcome

        outcomes.append(secret_outcome(box, fx.gateway_dir, settings=settings, vm=vm))
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
