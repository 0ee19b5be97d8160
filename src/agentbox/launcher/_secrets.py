"""The secrets a task's egress rules inject, resolved for the user who submitted it.

The launcher knows a task's owner: ``row.caller_uid``, the uid the kernel reported for
the connection that submitted it (or the in-process caller's own uid). That, never a
Boxfile field, decides whose secrets a task can use: its owner's own, else root's shared
ones. The values go to the egress proxy only (an inherited pipe at spawn); nothing here
logs them.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentbox.config import Settings
from agentbox.errors import PolicyRefused
from agentbox.launcher._store import TaskRow
from agentbox.secrets import resolve_for_task


def task_secrets(settings: Settings, row: TaskRow, templates: Iterable[str]) -> dict[str, str]:
    """Every ``${secret:NAME}`` the ``templates`` (the rules' inject values) name, with
    its value, for the task ``row``; :class:`~agentbox.errors.SecretNotFound` names a
    missing one. A task with no recorded submitter gets none (refused if it needs any)."""
    wanted = list(templates)
    if row.caller_uid is None:
        if any("${secret:" in t for t in wanted):
            raise PolicyRefused(
                f"task {row.id} has no recorded submitter: its secrets cannot be resolved"
            )
        return {}
    return resolve_for_task(settings, row.caller_uid, wanted)
