"""The hard deadline's second line: a watchdog process independent of the launcher.

The backend enforces a task's deadline itself (podman's ``--timeout``, run by
conmon). This watchdog is a separate process in its own session, started when
the sandbox starts: it sleeps until ``deadline + grace`` and then removes the
sandbox by name and kills the task's gateway, whatever state the launcher is in
(its event loop stuck, the process killed). The launcher terminates the watchdog
when the task ends in time; a restarted launcher kills stale ones.

Run as ``python -m agentbox.launcher._watchdog --backend B --sandbox NAME --data-dir D --at EPOCH
[--gateway-pid PID --gateway-start T]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from agentbox import _proc
from agentbox.errors import AgentboxError

__all__ = ["kill_sandbox", "main", "spawn_watchdog", "stop_watchdog"]

_MODULE = "agentbox.launcher._watchdog"


def kill_sandbox(backend: str, name: str, data_dir: Path) -> None:
    """Remove sandbox ``name`` of ``backend`` now (SIGKILL, then remove); idempotent.

    ``data_dir`` is the launcher's: microVMs are found by the owner files of their
    VM dirs there (and their VMMs killed through their cgroups).
    """
    if backend == "qemu":
        from agentbox.backends.qemu import kill_sandbox as kill_vm
        from agentbox.config import Settings

        with contextlib.suppress(AgentboxError, OSError):
            kill_vm(Settings(data_dir=data_dir), name)
        return
    if backend != "podman":
        return
    for argv in (
        ["podman", "kill", "--signal", "KILL", name],
        ["podman", "rm", "--force", "--time", "0", name],
    ):
        with contextlib.suppress(AgentboxError):
            _proc.run(argv, timeout=60, check=False)


def kill_gateway(pid: int, start: float) -> None:
    """Kill the gateway's process group if ``pid`` is still that very process."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start) > 0.01:
            return
    except psutil.Error:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def spawn_watchdog(
    *,
    backend: str,
    sandbox: str,
    data_dir: Path,
    at: float,
    gateway_pid: int | None,
    gateway_start: float | None,
    log_file: Path,
) -> subprocess.Popen[bytes]:
    """Start the watchdog for one sandbox, due at unix time ``at``; return its process."""
    argv = [sys.executable, "-m", _MODULE, "--backend", backend, "--sandbox", sandbox]
    argv += ["--data-dir", str(data_dir), "--at", repr(at)]
    if gateway_pid is not None and gateway_start is not None:
        argv += ["--gateway-pid", str(gateway_pid), "--gateway-start", repr(gateway_start)]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
    with log_file.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,  # survives the launcher and its signals
            close_fds=True,
        )


def is_watchdog(pid: int) -> bool:
    """Whether ``pid`` is a watchdog of ours (checked before signalling a stored pid)."""
    try:
        return _MODULE in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def stop_watchdog(pid: int) -> None:
    """Terminate the watchdog ``pid`` if it is one of ours; idempotent."""
    if is_watchdog(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(5)


def main(argv: list[str] | None = None) -> int:
    """Sleep until the deadline, then kill the sandbox and the gateway."""
    ap = argparse.ArgumentParser(prog=_MODULE)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--sandbox", required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--at", type=float, required=True)
    ap.add_argument("--gateway-pid", type=int)
    ap.add_argument("--gateway-start", type=float)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while (left := args.at - time.time()) > 0:
        time.sleep(min(left, 30.0))
    print(f"watchdog: deadline reached, removing sandbox {args.sandbox}", flush=True)
    kill_sandbox(args.backend, args.sandbox, args.data_dir)
    if args.gateway_pid is not None and args.gateway_start is not None:
        kill_gateway(args.gateway_pid, args.gateway_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
