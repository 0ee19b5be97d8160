"""Positive controls: deliberately weakened sandboxes on which every probe must fire.

A probe that cannot fail proves nothing. Each probe names its control in the
registry; this module runs them with as few sandbox starts as possible:

* ``weak``: ONE container started with plain ``podman run`` (not through the
  backend: the backend cannot drop its own user namespace, and that is the
  point). It is privileged, root in the host's user namespace, in the host's
  network/pid/ipc/uts/cgroup namespaces, without seccomp, with /proc unmasked
  and no pids or memory limit; it mounts a host directory at its own path (so
  host paths, workspace links and ``../`` reach it), the launcher's directory
  (token file and socket), a fake engine socket, fake ``apt``/``su`` and a
  setuid file, a writable "read-only" mount, a writable ``/opt/agentbox`` and
  claude, and a ``suid,dev`` tmpfs; the token is in its environment and command line.
  Nothing in it writes to the host: kernel files are only opened, the host
  directory is read-only, keys added are revoked.
* ``tty`` and ``fd``: the probe exec'd into the *real* (hardened) sandbox with a
  terminal (``exec -t``) or with a host file descriptor (``--preserve-fds``).
* ``stall``: the latency meter run while this process withholds the CPU from it.
* ``kernel``: the own-kernel comparison run against the runc control (shared kernel).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX, LABEL, ExecResult
from agentbox.backends.podman import conmon_cwd
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, CommandError, SandboxError
from agentbox.escape import _hostcheck as hc
from agentbox.escape._fixtures import RO_TARGET, TOKEN_ENV, Fixture
from agentbox.escape._hostview import HostView, host_outcomes, kernel_outcome
from agentbox.escape._meters import forkbomb_outcomes, latency_outcome, quota_outcomes
from agentbox.escape._model import Outcome, ProbeSpec, Status
from agentbox.escape._probeio import _parse_json, inside_outcomes, probe_source, run_probe_program
from agentbox.escape._registry import PROBES

log = get_logger(__name__)


def _shared_kernel_runtime() -> str:
    """runc, or crun where runc is missing: the control must share the host's kernel."""
    from agentbox.core import host as _host

    return "runc" if _host.podman_runtime("runc").ok else "crun"


class WeakContainer:
    """The deliberately weakened control container (plain ``podman run``); see the module doc."""

    def __init__(self, fx: Fixture, image: str, name: str) -> None:
        self.fx = fx
        self.image = image
        self.name = name

    def argv(self) -> list[str]:
        """The ``podman run`` command line of the weakened container."""
        fx = self.fx
        claude = fx.weak_dir / "claude"
        claude.write_text("fake agent binary, writable on purpose\n")
        env_file = fx.weak_dir / "env"
        env_file.write_text(f"{TOKEN_ENV}={fx.token}\nDOCKER_HOST=unix:///run/podman/podman.sock\n")
        return [
            "podman", "--runtime", _shared_kernel_runtime(), "run", "-d", "--name", self.name,
            "--pull", "never",
            "--label", f"{LABEL}=1", "--label", f"io.agentbox.owner-pid={os.getpid()}",
            "--privileged", "--user", "0:0",
            "--network", "host", "--pid", "host", "--ipc", "host", "--uts", "host",
            "--cgroupns", "host",
            "--security-opt", "seccomp=unconfined", "--security-opt", "unmask=ALL",
            "--security-opt", "label=disable",
            "--pids-limit", "-1",
            # Explicit: podman's default nproc cannot be set here (see DESIGN.md); root ignores it.
            "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
            "--env-file", str(env_file),
            "--tmpfs", "/ctl:rw,suid,dev,exec",
            "-v", f"{fx.control_workspace}:/workspace:rw",
            "-v", f"{fx.gateway_dir}:{GATEWAY_DIR_IN_SANDBOX}:rw",
            "-v", f"{fx.ro_dir}:{RO_TARGET}:rw",
            "-v", f"{fx.marker_dir}:{fx.marker_dir}:ro",
            "-v", f"{fx.launcher_dir}:/run/agentbox/launcher:ro",
            "-v", f"{fx.weak_dir / 'podman.sock'}:/run/podman/podman.sock",
            "-v", f"{fx.weak_dir / 'bin'}:/usr/local/sbin:ro",
            "-v", f"{fx.weak_dir / 'opt'}:/opt/agentbox:rw",
            "-v", f"{claude}:/usr/local/bin/claude:rw",
            "--workdir", "/workspace",
            self.image,
            # The token in a command line (the shell stays: "; :" stops it exec'ing sleep).
            "sh", "-c", "sleep infinity; :", fx.token,
        ]  # fmt: skip

    def start(self) -> None:
        """Start it (detached)."""
        try:
            _proc.run(self.argv(), timeout=120, cwd=conmon_cwd())
        except CommandError as exc:
            self.destroy()
            raise SandboxError(
                f"control container did not start: {exc}", sandbox=self.name
            ) from exc

    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Any = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_stdout: Any = None,
        on_stderr: Any = None,
    ) -> ExecResult:
        """``podman exec`` as root (the control's user)."""
        args = ["podman", "exec"] + (["-i"] if stdin is not None else []) + [self.name, *argv]
        res = _proc.run(args, timeout=timeout or 120, check=False, input=stdin, cwd=conmon_cwd())
        return ExecResult(res.returncode, res.stdout.encode(), res.stderr.encode())

    def pid(self) -> int:
        """The host pid of its init."""
        res = _proc.run(["podman", "inspect", "--format", "{{.State.Pid}}", self.name], timeout=30)
        return int(res.stdout.strip() or "0")

    def destroy(self) -> None:
        """Remove it (idempotent)."""
        with contextlib.suppress(AgentboxError):
            _proc.run(["podman", "rm", "-f", "--ignore", "--time", "0", self.name], timeout=60)


def control_outcome(spec: ProbeSpec, probe: Outcome | None, control: str) -> Outcome:
    """A control's verdict: ``pass`` when the probe fired on the weakened sandbox.

    A probe that is n/a on the control too (the kernel has no such file) stays
    ``n/a``, said explicitly; one that stayed quiet is a ``fail`` of the suite.
    """
    if probe is None:
        status: Status = "fail"
        seen = "the probe gave no answer on the control"
    elif probe.status == "n/a":
        status, seen = "n/a", f"n/a on the control too: {probe.seen}"
    elif probe.fired:
        status, seen = "pass", f"fired: {probe.seen}"
    else:
        status, seen = "fail", f"did NOT fire: {probe.seen}"
    return Outcome(spec.id, spec.where, f"[{control}] {spec.tried}", "fires", seen[:400], status)


def run_weak_controls(
    fx: Fixture, image: str, *, uid: int, mapped_uid: int, settings: Settings | None = None
) -> list[Outcome]:
    """Start the weak container, run every ``weak``/``kernel`` probe on it, remove it.

    The gateway's posture checks fire on a gateway spawned unconfined (``settings``:
    whose gateway identity and models; the defaults when not given).
    """
    box = WeakContainer(fx, image, f"agentbox-escape-{fx.marker_nonce[-12:]}-ctl")
    box.start()
    try:
        cfg = fx.probe_config(uid=uid, pids_max=512)
        got = {o.id: o for o in inside_outcomes(run_probe_program(box, cfg))}
        # The secret planted where a careless broker would put it: the probe must find it
        # (before the fork bomb, which may take the weak container down).
        from agentbox.escape._secret import suite_outcome as secret_outcome

        got["host.secret_not_in_sandbox"] = secret_outcome(box, fx.gateway_dir, control=True)
        # The egress controls, before the fork bomb too.
        # The egress proxy with its address checks off: localhost must get through.
        from agentbox.escape._egress import suite_outcome as escape_outcome

        got["host.egress_proxy_inner"] = escape_outcome(box, fx.gateway_dir, control=True)
        # The injecting rule widened to every probe host: the redirect carries the header.
        from agentbox.escape._inject import PUSH_PROBE_ID
        from agentbox.escape._inject import suite_outcome as inject_outcome

        got["host.egress_injection_scope"] = inject_outcome(box, fx.gateway_dir, control=True)
        # [git] fetch's rules replaced by one that lets everything through: a push arrives.
        got[PUSH_PROBE_ID] = inject_outcome(box, fx.gateway_dir, control=True, probe=PUSH_PROBE_ID)
        view = HostView(runtime="runc", mapped_uid=mapped_uid, pids_max=512, memory=512 * 1024**2)
        pids = hc.cgroup_pids(box.pid())
        got.update({o.id: o for o in host_outcomes(pids, view)})
        # Root in the host's user namespace: its counters are root's own, so root loses.
        got.update({o.id: o for o in quota_outcomes(box, view)})
        got.update({o.id: o for o in forkbomb_outcomes(box, view, pids[0] if pids else 0)})
        # Own kernel: a runc container shares the host's kernel, so the comparison must say so.
        got["host.own_kernel"] = kernel_outcome(box, "control", shares_host_kernel=False)
        # The gateway unconfined, as root: what its confinement is measured against.
        from agentbox.escape._gateway import gateway_outcomes

        got.update({o.id: o for o in gateway_outcomes(settings or Settings(), control=True)})
    finally:
        box.destroy()
    return [
        control_outcome(s, got.get(s.id), s.control)
        for s in PROBES
        if s.control in ("weak", "kernel")
    ]


def _exec_probe(args: list[str], what: str) -> dict[str, Any]:
    res = _proc.run(args, timeout=120, check=False, cwd=conmon_cwd())
    return _parse_json(res.stdout.replace("\r", "").encode(), f"{what} (exit {res.returncode})")


def exec_controls(sandbox_name: str, uid: int) -> list[Outcome]:
    """The ``tty`` and ``fd`` controls, exec'd into the live hardened sandbox ``sandbox_name``."""
    src = probe_source()
    specs = {s.id: s for s in PROBES}
    out = []
    py = ["python3", "-I", "-S", "-c", src]
    user = ["--user", f"{uid}:{uid}"]
    # tty: a terminal allocated for the exec; TIOCSTI into it must be seen.
    try:
        data = _exec_probe(
            ["podman", "exec", "-t", *user, sandbox_name, *py, "--only", "tty.tiocsti"], "tty"
        )
        o = {x.id: x for x in inside_outcomes(data)}.get("tty.tiocsti")
    except AgentboxError as exc:
        log.warning("tty control failed", error=str(exc))
        o = None
    out.append(control_outcome(specs["tty.tiocsti"], o, "tty"))
    # fd: a host file passed in as fd 3 must be flagged.
    leak = Path(f"/proc/{os.getpid()}/status")
    try:
        data = _exec_probe(
            ["sh", "-c", 'exec 3<"$0" && exec "$@"', str(leak),
             "podman", "exec", "--preserve-fds", "1", *user, sandbox_name, *py,
             "--only", "fd.no_leaked_fds"],
            "fd",
        )  # fmt: skip
        o = {x.id: x for x in inside_outcomes(data)}.get("fd.no_leaked_fds")
    except AgentboxError as exc:
        log.warning("fd control failed", error=str(exc))
        o = None
    out.append(control_outcome(specs["fd.no_leaked_fds"], o, "fd"))
    return out


def stall_control() -> Outcome:
    """The latency meter must notice a stall: this process keeps the CPU from it for ~0.8 s."""
    spec = next(s for s in PROBES if s.id == "host.forkbomb_latency")
    meter = hc.LatencyMeter()
    meter.start()
    old = sys.getswitchinterval()
    try:
        time.sleep(0.05)
        # The meter thread cannot take the interpreter back for up to 2 s: a stall.
        sys.setswitchinterval(2.0)
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)
        time.sleep(0.05)
        meter.stop()
    return control_outcome(spec, latency_outcome(meter), "stall")
