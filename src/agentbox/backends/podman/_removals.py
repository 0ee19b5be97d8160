"""podman bookkeeping off the path a task's user waits on: an ended sandbox's removal,
a claimed pool sandbox's rename.

Once a follower has recorded a sandbox's end and settled its workspace, nothing of
the task needs the exited container: ``podman rm`` (a podman client, ~0.2 s) is
started here on a tracked thread and the task goes on to be collected and published
meanwhile.

Who sees a removal that did not finish:

* this process: :func:`remove_later` threads are *not* daemons, so an interpreter
  that exits normally (a foreground ``agentbox run`` after its result is printed)
  joins them first; :func:`wait` joins them explicitly;
* a process killed mid-removal: the ``podman rm`` child runs in its own session and
  goes on without it; if it is killed too, the container (exited, still labelled
  with the data dir, its task terminal) is listed by the backend's ``owned()`` and
  reaped by the next launcher's orphan sweep (``launcher._adopt.remove_orphans``),
  like any sandbox no live task holds.

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

import threading
from collections.abc import Callable

import psutil

from agentbox.backends.oci._cli import force_remove
from agentbox.backends.podman._exitfile import CONMON_EXIT_WAIT, wait_exited
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError

log = get_logger(__name__)

_lock = threading.Lock()
_pending: dict[str, threading.Thread] = {}
_renames: dict[str, threading.Thread] = {}


def remove_later(name: str, *, after: psutil.Process | None = None) -> None:
    """Start removing container ``name`` (``podman rm --force``) on a tracked thread,
    once process ``after`` (its conmon, finishing podman's cleanup) has exited."""

    def remove() -> None:
        try:
            if after is not None:
                wait_exited(after, CONMON_EXIT_WAIT)
            await_rename(name)
            force_remove(name)
        except AgentboxError as exc:
            log.warning("could not remove an ended sandbox; the orphan sweep will", sandbox=name,
                        error=str(exc))  # fmt: skip
        finally:
            with _lock:
                if _pending.get(name) is threading.current_thread():
                    del _pending[name]

    # Not a daemon: an interpreter exiting normally waits for it (see the docstring).
    thread = threading.Thread(target=remove, name=f"agentbox-rm-{name}", daemon=False)
    with _lock:
        _pending[name] = thread
        thread.start()


def pending() -> list[str]:
    """The names whose removal this process started and has not finished."""
    with _lock:
        return sorted(_pending)


def wait(name: str | None = None, timeout: float | None = None) -> bool:
    """Join the removal of ``name`` (every pending one when None); True once none of
    them is pending (False: ``timeout`` passed first)."""
    with _lock:
        threads = [t for n, t in _pending.items() if name is None or n == name]
    for thread in threads:
        thread.join(timeout)
    return not any(t.is_alive() for t in threads)


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
