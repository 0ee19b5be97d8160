"""The sandbox's last line: a watchdog process independent of its owner.

The backend enforces a sandbox's deadline itself (podman's ``--timeout``, run
by conmon; the qemu sandbox's timer). This watchdog is a separate process in
its own session, started next to the sandbox by the process that owns it (the
launcher for a task, the CLI for ``agentbox exec``/``shell``). It removes the
sandbox by name, and kills the task's gateway, in either of two cases:

* **the owner died** (SIGKILL included, or any signal the owner did not catch):
  the watchdog holds a pidfd on the owner and wakes the moment it exits. The
  sandbox is *reaped* (:meth:`~agentbox.backends.base.Backend.reap`): killed,
  whatever it wrote saved where its owner would have collected it (a microVM's
  ``/data`` disk into its workspace), and removed. A restarted launcher then
  only has to collect and mark the task.
* **the deadline passed** (``deadline + grace``), whatever state the owner is in
  (its event loop stuck): the sandbox is *killed*
  (:meth:`~agentbox.backends.base.Backend.kill`) and its owner collects.

The owner terminates the watchdog when the sandbox ends in time; a restarted
launcher kills stale ones.

Memory: one watchdog runs per live sandbox, so the waiting process is kept
small. This module imports only the standard library at load time and is run
as a *script* under ``python -I -S`` (no site-packages, so neither the agentbox
package nor pydantic is imported): about 10 MB of RSS instead of the ~47 MB a
``python -m agentbox...`` process costs. Only when it has to act does it
``exec`` the full interpreter (``--act``) to reach the backends.

Run as ``python -I -S .../_watchdog.py --backend B --sandbox NAME --data-dir D --at EPOCH
[--owner-pid PID --owner-start TICKS] [--gateway-pid PID --gateway-start T] [--scratch DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

_MODULE = "agentbox.launcher._watchdog"
#: How the script shows in a process's command line (``is_watchdog``).
_SCRIPT_TAIL = "agentbox/launcher/_watchdog.py"
#: The longest single sleep: the deadline is wall-clock time, re-read after each.
_MAX_SLEEP = 30.0

Why = Literal["deadline", "owner"]


def process_start(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field
    22): with the pid, it names one process even after the pid is reused. 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and ')': split after its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def kill_sandbox(backend: str, name: str, data_dir: Path) -> None:
    """Kill sandbox ``name`` of ``backend`` now (its owner collects what it wrote); idempotent.

    Dispatches to the backend's own :meth:`~agentbox.backends.base.Backend.kill`:
    no backend is special-cased here. ``data_dir`` is the owner's (microVMs are
    found by the owner files of their VM dirs there). Errors are logged, never
    raised: the caller is a cancel, a deadline or a watchdog.
    """
    _act("kill", backend, name, data_dir)


def reap_sandbox(backend: str, name: str, data_dir: Path) -> list[str]:
    """Remove sandbox ``name`` whose owner died: kill it, save what it wrote, remove it
    (:meth:`~agentbox.backends.base.Backend.reap`); idempotent, never raises. Returns
    what was removed: nothing for one already gone, or one whose owner is alive (a
    microVM's exec or shell, left be by its backend)."""
    return _act("reap", backend, name, data_dir)


def _act(verb: Literal["kill", "reap"], backend: str, name: str, data_dir: Path) -> list[str]:
    from agentbox.backends import get_backend
    from agentbox.config import Settings
    from agentbox.core.log import get_logger
    from agentbox.errors import AgentboxError

    # Run as ``python -m`` this module's __name__ is __main__: named by its spec.
    log = get_logger(__spec__.name if __spec__ else __name__)
    try:
        be = get_backend(backend, Settings(data_dir=data_dir))
        done = be.kill(name) if verb == "kill" else be.reap(name)
    except (AgentboxError, OSError) as exc:
        log.error(f"could not {verb} the sandbox", backend=backend, sandbox=name, error=str(exc))
        return []
    if done:  # only what was acted on: a sandbox left be is not news
        event = "killed the sandbox" if verb == "kill" else "reaped the sandbox"
        log.info(event, backend=backend, sandbox=name, found=done)
    return done


def kill_gateway(pid: int, start: float) -> None:
    """Kill the gateway's process group if ``pid`` is still that very process."""
    import psutil

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
    log_file: Path | None,
    scratch: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start the watchdog for one sandbox owned by *this* process; return its process.

    It acts at unix time ``at``, or as soon as this process dies, whichever comes
    first. ``scratch`` (a throw-away workspace under ``data_dir/scratch``) is
    removed after a reap. ``log_file`` None discards its output.
    """
    me = os.getpid()
    argv = [sys.executable, "-I", "-S", str(Path(__file__).resolve())]
    argv += ["--backend", backend, "--sandbox", sandbox]
    argv += ["--data-dir", str(data_dir), "--at", repr(at)]
    argv += ["--owner-pid", str(me), "--owner-start", str(process_start(me))]
    if gateway_pid is not None and gateway_start is not None:
        argv += ["--gateway-pid", str(gateway_pid), "--gateway-start", repr(gateway_start)]
    if scratch is not None:
        argv += ["--scratch", str(scratch)]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
    out = log_file.open("ab") if log_file is not None else None
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out if out is not None else subprocess.DEVNULL,
            stderr=out if out is not None else subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # survives its owner, the owner's terminal and signals
            close_fds=True,
        )
    finally:
        if out is not None:
            out.close()


def is_watchdog(pid: int) -> bool:
    """Whether ``pid`` is a watchdog of ours (checked before signalling a stored pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(a == _MODULE or a.endswith(_SCRIPT_TAIL) for a in args)


def stop_watchdog(pid: int) -> None:
    """Terminate the watchdog ``pid`` if it is one of ours; idempotent."""
    import psutil

    if is_watchdog(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(5)


def _owner_fd(pid: int, start: int) -> int | None:
    """A pidfd on the owner if it is still that very process; None if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Opened first, checked second: a pid reused after the check cannot slip in.
    if process_start(pid) != start:
        os.close(fd)
        return None
    return fd


def _wait(at: float, owner_pid: int | None, owner_start: int) -> Why:
    """Sleep until the deadline or the owner's death, whichever comes first."""
    poller = select.poll()
    if owner_pid is not None:
        fd = _owner_fd(owner_pid, owner_start)
        if fd is None:
            return "owner"
        poller.register(fd, select.POLLIN)  # readable once the process has exited
    while (left := at - time.time()) > 0:
        if poller.poll(int(min(left, _MAX_SLEEP) * 1000) + 1):
            return "owner"
    return "deadline"


def _wait_reaped(pid: int, start: int, timeout: float = 10.0) -> None:
    """Give the dead owner's parent a moment to reap it.

    Until then the owner is a zombie, and the backends' liveness checks
    (``kill(pid, 0)``, psutil) still count it alive, so a reap could skip its
    sandbox's records. Past ``timeout`` we act anyway (the sandbox is killed by name).
    """
    # A plain loop, not agentbox.core.wait.wait_until: this runs in the light stdlib-only
    # process (python -I -S), which cannot import agentbox.
    end = time.monotonic() + timeout
    while start and process_start(pid) == start and time.monotonic() < end:
        time.sleep(0.05)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=_MODULE)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--sandbox", required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--at", type=float, required=True)
    ap.add_argument("--owner-pid", type=int)
    ap.add_argument("--owner-start", type=int, default=0)
    ap.add_argument("--gateway-pid", type=int)
    ap.add_argument("--gateway-start", type=float)
    ap.add_argument("--scratch", type=Path)
    ap.add_argument("--act", choices=("deadline", "owner"), help=argparse.SUPPRESS)
    return ap


def _remove_scratch(scratch: Path, data_dir: Path) -> None:
    """Remove the dead owner's throw-away workspace: only a direct child of data_dir/scratch."""
    import shutil

    root = (data_dir / "scratch").resolve()
    if scratch.parent.resolve() == root and not scratch.is_symlink():
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Wait for the deadline or the owner's death, then remove the sandbox and the gateway."""
    raw = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(raw)
    if args.act is None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        why = _wait(args.at, args.owner_pid, args.owner_start)
        what = "deadline reached" if why == "deadline" else "its owner is gone"
        print(f"watchdog: {what}, removing sandbox {args.sandbox}", flush=True)
        if why == "owner" and args.owner_pid is not None:
            _wait_reaped(args.owner_pid, args.owner_start)
        if sys.flags.no_site:
            # The light waiting process cannot reach the backends: become the full
            # interpreter (same pid, so the owner's records still name us).
            full = [sys.executable, "-I", "-m", _MODULE, *raw, "--act", why]
            os.execv(sys.executable, full)  # noqa: S606 (argv list, our own interpreter)
        args.act = why
    # Acting: a stop request now would leave a half-removed sandbox; finish first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.act == "owner":
        reap_sandbox(args.backend, args.sandbox, args.data_dir)
        if args.scratch is not None:
            _remove_scratch(args.scratch, args.data_dir)
    else:
        kill_sandbox(args.backend, args.sandbox, args.data_dir)
    if args.gateway_pid is not None and args.gateway_start is not None:
        kill_gateway(args.gateway_pid, args.gateway_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
