"""Cancelling a task: at once when no worker has taken it, else through whoever runs it.

A worker *takes* a queued task by setting its stage (``preparing``) while its
status is still ``queued``: it then copies the workspace, starts the gateway and
runs the setup, all under ``queued``, and only a launch makes it ``running``.
So ``queued`` alone does not say that nothing runs. A cancel:

* flips a task to ``cancelled`` itself only while it is queued *and untaken*
  (stage NULL), in one compare-and-set against the worker's own take (one of
  the two wins; the loser sees it): nothing of it ran, nothing is collected;
* otherwise raises the task's cancel flag in the store (read by a worker of any
  launcher at its next step) and this launcher's event, and kills its sandbox
  if one is recorded. The worker stops at its next step (no gateway, setup or
  sandbox starts after it), kills what runs, collects what exists, writes the
  report and only then records ``cancelled``: a ``wait()`` returns with the
  final state and the report written;
* a task whose launcher died is claimed (one canceller or reconciler wins) and
  settled here: one it had taken but not launched is ``cancelled`` and what the
  dead launcher left (gateway, setup sandbox) removed.

Idempotent: a second cancel finds the flag raised or the task terminal.
"""

from __future__ import annotations

import threading
import time

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.launcher._adopt import settle_orphan
from agentbox.launcher._finish import NEVER_STARTED
from agentbox.launcher._store import Owner, Store, TaskRow
from agentbox.launcher._watchdog import kill_sandbox

log = get_logger(__name__)


def cancel_task(
    settings: Settings,
    store: Store,
    row: TaskRow,
    event: threading.Event | None,
    me: Owner,
) -> None:
    """Cancel the non-terminal task ``row``; ``event`` is this launcher's for it (None when
    this launcher does not run it), ``me`` this launcher (the claimer of an orphan)."""
    # First the flag: a worker that takes the task after this point sees it.
    store.update(row.id, cancel_requested=1)
    if row.status == "queued" and store.update(
        row.id,
        expect={"queued"},
        unstaged=True,
        status="cancelled",
        finished_at=time.time(),
        error=NEVER_STARTED,
    ):
        log.info("task cancelled before a worker took it", task_id=row.id)
        return
    if event is not None:
        event.set()
    if row.sandbox and row.backend:
        # Whoever runs it sees the sandbox die and the cancel flag, and collects.
        kill_sandbox(row.backend, row.sandbox, settings.data_dir)
    if event is None and row.owner is not None and not row.owner.alive():
        _orphan(settings, store, store.get(row.id), me)


def _orphan(settings: Settings, store: Store, row: TaskRow, me: Owner) -> None:
    """A task whose launcher died: claim it first, so two cancellers or reconcilers do not
    both settle it; one that never reached its agent is cancelled, then its leftovers go."""
    if not store.claim(row.id, row.owner, me):
        return
    if row.status == "queued":
        store.update(
            row.id,
            expect={"queued"},
            status="cancelled",
            finished_at=time.time(),
            error=f"{NEVER_STARTED} (its launcher had died)",
        )
    settle_orphan(settings, store, row, None)  # removes what is left; marks it if not yet
