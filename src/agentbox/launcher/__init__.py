"""The launcher: the only privileged component of agentbox.

Clients choose which task and which model, never how. The wire schema is in
:mod:`agentbox.launcher.api`, the unix-socket client in
:mod:`agentbox.launcher.client`, the in-process API in
:class:`agentbox.launcher.Launcher` (imported lazily: it pulls in the backends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentbox.launcher.api import (
    ModelInfo,
    TaskInfo,
    TaskRequest,
    TaskResult,
    TaskStatus,
    TokenUsage,
)

if TYPE_CHECKING:
    from agentbox.launcher._core import Launcher
    from agentbox.launcher._retention import Removal as Removal
    from agentbox.launcher._retention import data_usage as data_usage
    from agentbox.launcher._retention import parse_age as parse_age
    from agentbox.launcher._retention import prune as prune
    from agentbox.launcher._retention import remove_task as remove_task
    from agentbox.launcher._server import serve as serve
    from agentbox.launcher._server import socket_path as socket_path
    from agentbox.launcher._stop import stop_launcher as stop_launcher
    from agentbox.launcher._store import Store as Store
    from agentbox.launcher._watchdog import spawn_watchdog as spawn_watchdog
    from agentbox.launcher.client import LauncherClient

__all__ = [
    "Launcher",
    "LauncherClient",
    "ModelInfo",
    "TaskInfo",
    "TaskRequest",
    "TaskResult",
    "TaskStatus",
    "TokenUsage",
]
# Also importable from here, for the CLI (not the pinned library surface above): Removal,
# Store, data_usage, parse_age, prune, remove_task, serve, socket_path, spawn_watchdog,
# stop_launcher.

#: Names imported on first use (each pulls in the backends, the store or the server).
_LAZY = {
    "Launcher": "agentbox.launcher._core",
    # httpx (~0.3 s): not for the daemon, which serves and never calls
    "LauncherClient": "agentbox.launcher.client",
    "Removal": "agentbox.launcher._retention",
    "data_usage": "agentbox.launcher._retention",
    "parse_age": "agentbox.launcher._retention",
    "prune": "agentbox.launcher._retention",
    "remove_task": "agentbox.launcher._retention",
    "serve": "agentbox.launcher._server",
    "socket_path": "agentbox.launcher._server",
    "Store": "agentbox.launcher._store",
    "stop_launcher": "agentbox.launcher._stop",
    "spawn_watchdog": "agentbox.launcher._watchdog",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
