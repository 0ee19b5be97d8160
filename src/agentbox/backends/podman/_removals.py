"""podman bookkeeping off the path a task's user waits on: an ended sandbox's removal,
a claimed pool sandbox's rename.

Once a follower has recorded a sandbox's end and settled its workspace, nothing of
the task needs the exited container: ``podman rm`` (a podman client, ~0.2 s, after
conmon has run podman's cleanup, 0.3-0.5 s) is started here and the task goes on to
be collected and published meanwhile.

The removal runs in a process of its own session (a small ``python3 -I -S``: it waits
for conmon's pidfd, then runs ``podman rm``, retried), so it outlives the process that
started it: a foreground ``agentbox run`` (or the front end's fork that serves one)
exits once its result is printed, without waiting for it. This process tracks it (a
daemon thread waits for it: :func:`pending`, :func:`wait`). A remover killed before
it removed the container (the host's shutdown) leaves an exited container, still
labelled with its data dir, its task terminal: the backend's ``owned()`` lists it and
the next launcher's orphan sweep (``launcher._adopt.remove_orphans``) reaps it, like
any sandbox no live task holds.

A removal that fails is logged, not raised: its container is left to that sweep.

A pool claim (:mod:`._pool`) starts its task's command before the container carries
the task's name; ``podman rename`` (~0.3 s) then finishes on a thread
(:func:`rename_later`). Until it has, nothing in this process addresses the sandbox
by that name without :func:`await_rename` first (the follower's end and deadline
kill, ``kill``, ``reap``, ``inspect``). A rename that fails kills the container by
its id: its follower then records the end (exit 137) and settles it as any other.
A launcher killed meanwhile leaves the ``podman rename`` child (its own session)
running; an adopter that came first finds no such sandbox and settles the task, and
the renamed container, its task terminal, is then the orphan sweep's.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil

from agentbox.backends.oci._cli import force_remove
from agentbox.backends.podman._exitfile import CONMON_EXIT_WAIT
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError

log = get_logger(__name__)

_lock = threading.Lock()
_pending: dict[str, threading.Thread] = {}
_renames: dict[str, threading.Thread] = {}


#: The remover: waits for conmon (its pidfd, argv[1], or -1) to exit, at most argv[3]
#: seconds, then ``podman rm`` of argv[2], retried (runsc may still hold a mount).
_REMOVER = """
import os, select, subprocess, sys, time
fd, name, wait = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
if fd >= 0:
    p = select.poll()
    p.register(fd, select.POLLIN)
    p.poll(int(wait * 1000))
    os.close(fd)
argv = ["podman", "rm", "--force", "--ignore", "--time", "0", name]
for i in range(5):
    res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if res.returncode == 0:
        sys.exit(0)
    time.sleep(0.2 * (i + 1))
sys.stderr.buffer.write(res.stderr[-2000:])
sys.exit(1)
"""


def remove_later(name: str, *, after: psutil.Process | None = None) -> None:
    """Start removing container ``name`` (``podman rm --force``) in a process of its
    own session, once process ``after`` (its conmon, finishing podman's cleanup) has
    exited; a daemon thread of this process waits for it and logs a failure.

    Returns at once: the remover is started by a thread (a process's start, 3-20 ms of
    this one's on a busy host, was on the path from the sandbox's end to its task's
    result), at nice :data:`REMOVER_NICE` (it and its ``podman rm`` no longer compete
    with that path for the cores). The thread is not a daemon until the remover runs: a
    process that ends meanwhile (:func:`agentbox.core.exit.end_process`) waits for the
    start, never leaves the container unremoved for that."""
    fd = -1
    if after is not None:
        with contextlib.suppress(OSError):  # gone already: nothing to wait for
            fd = os.pidfd_open(after.pid)  # now: its pid cannot be another process's yet

    def start() -> None:
        try:
            await_rename(name)  # a pool claim's rename still under way (a task of < 0.3 s)
            proc = _spawn(name, fd)
        except BaseException:
            with _lock:
                if _pending.get(name) is threading.current_thread():
                    del _pending[name]
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        _track(name, proc)

    thread = threading.Thread(target=start, name=f"agentbox-rm-start-{name}", daemon=False)
    with _lock:
        _pending[name] = thread
        thread.start()


#: The remover's nice value (its ``podman rm`` inherits it).
REMOVER_NICE = 10


def _spawn(name: str, fd: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-I", "-S", "-c", _REMOVER, str(fd), name, f"{CONMON_EXIT_WAIT:g}"]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(fd,) if fd >= 0 else (),
        start_new_session=True,  # outlives this process (and a Ctrl-C of its terminal)
        env=_remover_env(),
    )
    with contextlib.suppress(OSError):  # (a preexec_fn would cost the fork its vfork)
        os.setpriority(os.PRIO_PROCESS, proc.pid, REMOVER_NICE)
    return proc


def _remover_env() -> dict[str, str]:
    """What podman needs of our environment and nothing else: the remover outlives its
    caller, and holds none of its values (a task's token, a test run's marker)."""
    keep = ("PATH", "TMPDIR", "XDG_RUNTIME_DIR", "HOME")
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith("CONTAINERS_")}


def _track(name: str, proc: subprocess.Popen[bytes]) -> None:
    thread = threading.Thread(target=_watch, args=(name, proc), name=f"agentbox-rm-{name}",
                              daemon=True)  # fmt: skip
    with _lock:
        _pending[name] = thread
        thread.start()


def _watch(name: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait for the remover ``proc``; log a failure (the orphan sweep removes it then)."""
    try:
        _, err = proc.communicate()
        if proc.returncode != 0:
            log.warning("could not remove an ended sandbox; the orphan sweep will", sandbox=name,
                        rc=proc.returncode, error=err.decode(errors="replace")[-500:])  # fmt: skip
    finally:
        with _lock:
            if _pending.get(name) is threading.current_thread():
                del _pending[name]


def pending() -> list[str]:
    """The names whose removal this process started and has not finished."""
    with _lock:
        return sorted(_pending)


def wait(name: str | None = None, timeout: float | None = None) -> bool:
    """Join the removal of ``name`` (every pending one when None); True once none of
    them is pending (False: ``timeout`` passed first). A removal's starter hands it to
    its watcher thread: looked up again until none is left."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            threads = [t for n, t in _pending.items() if name is None or n == name]
        if not threads:
            return True
        for thread in threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        if end is not None and time.monotonic() >= end:
            with _lock:
                return not any(
                    t.is_alive() for n, t in _pending.items() if name is None or n == name
                )


def rename_later(name: str, cid: str, rename: Callable[[], object]) -> None:
    """Run ``rename`` (container ``cid`` to ``name``) on a tracked thread; if it fails,
    kill and remove ``cid`` (its follower sees the end)."""

    def run() -> None:
        try:
            rename()
        except AgentboxError as exc:
            log.warning("could not rename a claimed pool sandbox; ending it", sandbox=name,
                        error=str(exc))  # fmt: skip
            try:
                force_remove(cid)
            except AgentboxError as rm_exc:
                log.warning("could not remove it either", sandbox=name, error=str(rm_exc))
        finally:
            with _lock:
                if _renames.get(name) is threading.current_thread():
                    del _renames[name]

    thread = threading.Thread(target=run, name=f"agentbox-rename-{name}", daemon=False)
    with _lock:
        _renames[name] = thread
        thread.start()


def await_rename(name: str, timeout: float = 120.0) -> None:
    """Return once no rename to ``name`` started by this process is under way."""
    with _lock:
        thread = _renames.get(name)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)
