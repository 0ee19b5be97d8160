"""A task's sandbox runs in a host uid range no other live sandbox holds (a uid slot).

The slot is claimed before the workspace is given to the sandbox's uid and released
when the task ends (:func:`agentbox.launcher._finish.collect_and_finish`), or here when
it ends before any sandbox ran. A launcher that dies leaves it held: the sandbox of a
detached task lives on, and the launcher that re-adopts the task releases it at the
end; one whose sandbox is gone is freed by the next reconcile
(:func:`agentbox.launcher._adopt.remove_orphans`). The pool of ranges:
``agentbox.backends._uidslots``.
"""

from __future__ import annotations

import threading

from agentbox.backends import claim_uid_slot, release_uid_slot, slot_settings
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.errors import AgentboxError
from agentbox.launcher._names import sandbox_name
from agentbox.launcher._runner import run_task
from agentbox.launcher._store import Store


def run_in_slot(settings: Settings, store: Store, task_id: str, cancel: threading.Event) -> None:
    """:func:`~agentbox.launcher._runner.run_task` with settings for the task's uid slot."""
    row = store.get(task_id)
    if row.status != "queued":
        return
    box = Boxfile.model_validate_json(row.boxfile or "{}")
    name = sandbox_name(task_id)
    try:
        slot = claim_uid_slot(settings, name)
        mine = slot_settings(box.backend, settings, slot)
    except AgentboxError as exc:
        release_uid_slot(settings, name)
        store.finish(task_id, "failed", error=str(exc))
        return
    try:
        run_task(mine, store, task_id, cancel)
    finally:
        after = store.get(task_id)
        # Kept while its sandbox may live on (a detached task left to the next launcher).
        if after.info().terminal or after.status == "queued":
            release_uid_slot(settings, name)
