"""What every stage of one task needs, in one object.

A task goes through stages (prepare, setup, run attached or detached, follow,
settle, collect and finish; or, after a launcher died, adopt and follow). Each
needs the same five things: the launcher's settings, its store, the task's
paths, its cancel event and its transcript log. :class:`TaskContext` carries
them; what only one stage needs (the row as read then, the Boxfile, the
token, the gateway, the backend, the spec) stays that stage's argument.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import AgentboxError
from agentbox.launcher._store import Store
from agentbox.observe.phases import PHASES_FILE


class TaskLog:
    """Timestamped lines in ``logs/launcher.log`` (for ``agentbox logs``); each is also the
    task's current ``phase`` in the store (for live progress)."""

    def __init__(self, paths: TaskPaths, store: Store) -> None:
        self.path = paths.log_dir / "launcher.log"
        self.store = store
        self.task_id = paths.task_id

    def __call__(self, msg: str) -> None:
        now = time.time()
        with contextlib.suppress(OSError), self.path.open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S', time.localtime(now))} {msg}\n")
        # The same line with its exact time, for phase durations (metrics, traces).
        with contextlib.suppress(OSError), (self.path.parent / PHASES_FILE).open("a") as fh:
            fh.write(json.dumps({"t": round(now, 3), "msg": msg[:500]}) + "\n")
        with contextlib.suppress(AgentboxError, sqlite3.Error):
            self.store.update(self.task_id, phase=msg[:200])


@dataclass(frozen=True)
class TaskContext:
    """One task's settings, store, paths, cancel event and transcript log."""

    settings: Settings
    store: Store
    paths: TaskPaths
    tlog: TaskLog
    #: Set by the launcher that stops; a cancel through the store is read separately.
    cancel: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def of(
        cls, settings: Settings, store: Store, task_id: str, cancel: threading.Event | None = None
    ) -> TaskContext:
        paths = TaskPaths(settings.data_dir, task_id)
        event = threading.Event() if cancel is None else cancel
        return cls(settings, store, paths, TaskLog(paths, store), event)

    @property
    def task_id(self) -> str:
        return self.paths.task_id

    def cancelled(self) -> bool:
        """This launcher's event, or the task's cancel flag in the store."""
        if self.cancel.is_set():
            return True
        with contextlib.suppress(AgentboxError):
            return self.store.get(self.task_id).cancel_requested
        return False
