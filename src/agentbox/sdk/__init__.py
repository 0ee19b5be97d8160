"""agentbox from Python: sandboxes (:class:`Sandbox`) and tasks (:class:`Client`), sync and async.

Everything goes through the launcher (``agentbox launcher serve``) over its unix
socket, so a member of the group ``agentbox`` needs no root; the launcher reads
who you are from the kernel and shows you only your own sandboxes and tasks.
Reference: docs/reference/sdk.md.
"""

from __future__ import annotations

from agentbox.launcher.api import TaskInfo, TaskResult
from agentbox.launcher.boxapi import ExecState, FileEntry, SandboxInfo
from agentbox.sdk._async import (
    AsyncClient,
    AsyncCommandHandle,
    AsyncCommands,
    AsyncCommandStream,
    AsyncFiles,
    AsyncSandbox,
    AsyncTask,
    AsyncTaskGroup,
    AsyncTasks,
)
from agentbox.sdk._sandbox import (
    CommandHandle,
    CommandResult,
    Commands,
    CommandStream,
    Files,
    OutputChunk,
    Sandbox,
)
from agentbox.sdk._tasks import Client, Task, TaskGroup, Tasks
from agentbox.sdk._transport import default_address

__all__ = [
    "AsyncClient",
    "AsyncCommandHandle",
    "AsyncCommandStream",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncTask",
    "AsyncTaskGroup",
    "AsyncTasks",
    "Client",
    "CommandHandle",
    "CommandResult",
    "CommandStream",
    "Commands",
    "ExecState",
    "FileEntry",
    "Files",
    "OutputChunk",
    "Sandbox",
    "SandboxInfo",
    "Task",
    "TaskGroup",
    "TaskInfo",
    "TaskResult",
    "Tasks",
    "default_address",
]
