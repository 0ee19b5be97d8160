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
from agentbox.launcher.client import LauncherClient

if TYPE_CHECKING:
    from agentbox.launcher._core import Launcher

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


def __getattr__(name: str) -> Any:
    if name == "Launcher":
        from agentbox.launcher._core import Launcher

        return Launcher
    raise AttributeError(name)
