"""The one exception tree of agentbox.

Every error agentbox raises on purpose derives from :class:`AgentboxError`;
errors of lower layers (subprocess, podman, QEMU, HTTP, sqlite) are translated
at the boundary with ``raise ... from exc`` and never leak raw. The tree is
grouped by what the caller can do about it::

    AgentboxError
    ├── ConfigError            bad settings, Boxfile, model registry: fix the input
    │   └── BoxfileError       names the offending key
    ├── RefusedError           a request that is well-formed but not allowed
    │   ├── PathRefused        a path outside its root, through a link, wrong owner
    │   ├── TaskIdRefused      an id that does not match ^[0-9a-z-]{1,64}$
    │   ├── PolicyRefused      a capability, a network, a command that is not claude …
    │   └── PublishRefused     a branch agentbox did not write, or one checked out: kept as
    │                          is (also a CollectError: the result is kept, unpublished)
    ├── UnsupportedError       the host lacks a facility (runtime, KVM, binary): install it
    ├── CommandError           a subprocess failed: argv, exit code, stderr tail
    │   └── CommandTimeout     ... or ran past its timeout
    ├── ImageError             building, verifying or finding an image failed
    ├── SandboxError           a sandbox could not be created, run or destroyed
    │   ├── SandboxTimeout     a sandbox ran past its deadline and was killed
    │   └── GuestError         a microVM guest misbehaved (bad frame, wrong kernel, no answer)
    ├── GatewayError           the per-task model gateway failed to start or serve
    ├── EgressError            the per-task egress proxy failed to start or serve
    ├── CollectError           result collection failed (the workspace is kept)
    └── TaskError              a task-level failure: carries the task id
        └── TaskNotFound
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "AgentboxError",
    "BoxfileError",
    "CollectError",
    "CommandError",
    "CommandTimeout",
    "ConfigError",
    "EgressError",
    "GatewayError",
    "GuestError",
    "ImageError",
    "PathRefused",
    "PolicyRefused",
    "PublishRefused",
    "RefusedError",
    "SandboxError",
    "SandboxTimeout",
    "TaskError",
    "TaskIdRefused",
    "TaskNotFound",
    "UnsupportedError",
]


class AgentboxError(Exception):
    """Root of every error agentbox raises on purpose."""


class ConfigError(AgentboxError):
    """Settings, a Boxfile or a registry file is invalid."""


class BoxfileError(ConfigError):
    """A Boxfile key is unknown or has a bad value; ``key`` names it."""

    def __init__(self, message: str, *, key: str | None = None, path: Path | None = None) -> None:
        where = f"{path}: " if path else ""
        named = f"[{key}] " if key else ""
        super().__init__(f"{where}{named}{message}")
        self.key = key
        self.path = path


class RefusedError(AgentboxError):
    """A well-formed request that policy does not allow. Nothing was started."""


class PathRefused(RefusedError):
    """A path resolves outside its allowed root, through a link, or has the wrong owner."""

    def __init__(self, message: str, *, path: Path | str | None = None) -> None:
        super().__init__(f"{message}: {path}" if path is not None else message)
        self.path = path


class TaskIdRefused(RefusedError):
    """A task id that does not match ``^[0-9a-z-]{1,64}$``."""


class PolicyRefused(RefusedError):
    """A capability, host networking, a non-``claude`` command, an env var not allowed…"""


class UnsupportedError(AgentboxError):
    """The host lacks a facility (a runtime, KVM, a binary); ``fix`` says how to get it."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{message} (fix: {fix})" if fix else message)
        self.fix = fix


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class CommandError(AgentboxError):
    """A subprocess failed. Carries argv, the exit code and the tail of stderr."""

    def __init__(
        self, argv: Sequence[str], returncode: int | None, stderr: str = "", stdout: str = ""
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        shown = " ".join(self.argv[:12]) + (" …" if len(self.argv) > 12 else "")
        msg = f"command failed (exit {returncode}): {shown}"
        if stderr.strip():
            msg += f"\n{_tail(stderr)}"
        super().__init__(msg)


class CommandTimeout(CommandError):
    """A subprocess ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout: float, stderr: str = "") -> None:
        super().__init__(argv, None, stderr)
        self.timeout = timeout
        self.args = (f"command timed out after {timeout:g}s: {' '.join(self.argv[:12])}",)


class ImageError(AgentboxError):
    """Building, verifying or finding a sandbox image failed."""


class SandboxError(AgentboxError):
    """A sandbox could not be created, run or destroyed; ``sandbox`` names it."""

    def __init__(self, message: str, *, sandbox: str | None = None) -> None:
        super().__init__(f"sandbox {sandbox}: {message}" if sandbox else message)
        self.sandbox = sandbox


class SandboxTimeout(SandboxError):
    """A sandbox ran past its deadline and was killed."""


class GuestError(SandboxError):
    """A microVM guest misbehaved: a malformed frame, the host's kernel, no answer."""


class GatewayError(AgentboxError):
    """The per-task model gateway failed to start or to serve."""


class EgressError(AgentboxError):
    """The per-task egress proxy failed to start or to serve."""


class CollectError(AgentboxError):
    """Result collection failed. The workspace is kept so it can be retried."""


class PublishRefused(CollectError, RefusedError):
    """Publishing a result would overwrite a ref agentbox did not write (or a branch that is
    checked out). Nothing in the user's repo changed; the result is kept in the shadow dir."""


class TaskError(AgentboxError):
    """A task-level failure; ``task_id`` names the task."""

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(f"task {task_id}: {message}" if task_id else message)
        self.task_id = task_id


class TaskNotFound(TaskError):
    """No task with that id is known to the launcher."""
