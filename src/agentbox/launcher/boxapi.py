"""The launcher's wire schema for sandboxes driven from Python (:mod:`agentbox.sdk`).

Routes (all under the launcher's unix socket, peer-checked like the task routes)::

    POST   /v1/sandboxes                         SandboxRequest -> SandboxInfo   (201)
    GET    /v1/sandboxes                                        -> SandboxList
    GET    /v1/sandboxes/{id}                                   -> SandboxInfo
    POST   /v1/sandboxes/{id}/connect                           -> SandboxInfo
    POST   /v1/sandboxes/{id}/fork               ForkRequest    -> SandboxList   (201)
    DELETE /v1/sandboxes/{id}                                   -> SandboxInfo
    POST   /v1/sandboxes/{id}/exec               ExecRequest    -> NDJSON lines (ExecEvent),
                                                                   or ExecHandle (background)
    GET    /v1/sandboxes/{id}/exec/{exec_id}                    -> ExecState
    POST   /v1/sandboxes/{id}/exec/{exec_id}/kill               -> ExecState
    PUT    /v1/sandboxes/{id}/files?path=P       raw bytes      -> FileEntry
    GET    /v1/sandboxes/{id}/files?path=P                      -> raw bytes
    GET    /v1/sandboxes/{id}/dir?path=P                        -> FileList
    PUT    /v1/sandboxes/{id}/archive?path=DIR   a tar          -> FileList (what landed)
    GET    /v1/sandboxes/{id}/archive?path=P                    -> a tar (links as links)

Who sees what: the caller's uid is the kernel's (``SO_PEERCRED``), never a field;
a non-root caller sees and reaches only the sandboxes it created (another's id is
answered 404, as an unknown one). A sandbox lives while a process that created or
connected to it lives (the launcher holds a pidfd on each such peer), and never past
its deadline.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_ARCHIVE",
    "MAX_FILE",
    "SANDBOX_ID_PATTERN",
    "ExecEvent",
    "ExecHandle",
    "ExecRequest",
    "ExecState",
    "FileEntry",
    "FileList",
    "SandboxInfo",
    "SandboxList",
    "SandboxRequest",
]

#: A sandbox id: ``sb-`` and 16 hex digits.
SANDBOX_ID_PATTERN = r"^sb-[0-9a-f]{16}$"
#: The largest file ``files.write``/``files.read`` moves.
MAX_FILE = 64 * 1024 * 1024
#: The largest tar ``upload``/``download`` moves.
MAX_ARCHIVE = 256 * 1024 * 1024
#: Deadline bounds, seconds.
MIN_TIMEOUT = 10.0
MAX_TIMEOUT = 24 * 3600.0


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)


class SandboxRequest(_Wire):
    """A sandbox to start: the Boxfile's shape (all optional), and its deadline."""

    image: str | None = Field(default=None, min_length=1, max_length=512)
    backend: str | None = Field(default=None, min_length=1, max_length=32)
    boxfile: str | None = Field(default=None, max_length=64 * 1024)
    """A Boxfile's TOML text (read by the client: the launcher opens no path of yours)."""
    timeout: float = Field(default=600.0, ge=MIN_TIMEOUT, le=MAX_TIMEOUT)
    """Seconds until the sandbox is removed, whatever it is doing."""


class ForkRequest(_Wire):
    """``n`` sandboxes starting from a live one's files, each with its own deadline."""

    n: int = Field(default=1, ge=1, le=8)
    timeout: float = Field(default=600.0, ge=MIN_TIMEOUT, le=MAX_TIMEOUT)


class SandboxInfo(_Wire):
    """One live sandbox."""

    id: str
    uid: int
    """Who created it (a non-root caller sees only its own)."""
    backend: str
    image: str
    created_at: float
    deadline_at: float
    """Unix time it is removed at, at the latest."""
    holders: int = 0
    """Live processes holding it (created or connected); none left: it is removed."""
    warm: bool = False
    """Whether it came from the launcher's warm spare."""


class SandboxList(_Wire):
    sandboxes: list[SandboxInfo]
    spare_ready: bool = False
    """Whether the launcher's warm spare waits (the next default ``create`` takes it)."""


class ExecRequest(_Wire):
    """One command: a shell string (``sh -c``) or an argv."""

    cmd: str | list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=4096)
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT)
    stdin: str | None = Field(default=None, max_length=MAX_FILE)
    background: bool = False


class ExecEvent(_Wire):
    """One line of an exec's NDJSON answer: a chunk of output, or its end."""

    kind: Literal["stdout", "stderr", "exit", "error"]
    data: str = ""
    """The chunk (``stdout``/``stderr``, UTF-8 with replacement), or the error's text."""
    exit_code: int | None = None
    timed_out: bool = False


class ExecHandle(_Wire):
    exec_id: str


class ExecState(_Wire):
    """A background command's state."""

    exec_id: str
    running: bool
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    """Output so far (capped at 1 MiB each, the tail kept)."""


class FileEntry(_Wire):
    name: str
    path: str
    type: Literal["file", "dir", "link", "other"]
    size: int = 0
    mode: int = 0


class FileList(_Wire):
    entries: list[FileEntry]
