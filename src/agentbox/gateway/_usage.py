"""The usage file: the gateway's running totals, read by the launcher.

The gateway rewrites it atomically (a temp file in the same directory, then
``os.replace``) after every request, so a reader never sees half a file.
Nobody parses model output to learn what a task spent: this file is the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentbox.errors import GatewayError
from agentbox.gateway._check import (
    Checker,
    Errors,
    Invalid,
    boolean,
    fields,
    integer,
    mapping_of,
    number,
    optional,
    text,
)


@dataclass
class Usage:
    """Running totals of one task's gateway (all token counts as the upstream reported them)."""

    model: str = ""
    """The registry name of the task's model."""
    input: int = 0
    """Uncached input tokens."""
    output: int = 0
    cache_creation: int = 0
    """Cache writes, 1-hour ones included."""
    cache_creation_1h: int = 0
    """1-hour cache writes (priced at their own rate)."""
    cache_read: int = 0
    weighted_total: float = 0.0
    """What the budget is charged: input + output + cache tokens times their weights."""
    budget: int = 0
    reserved: float = 0.0
    """Worst-case tokens held by requests in flight right now."""
    requests: int = 0
    """Requests answered (any status), count_tokens included."""
    refusals: dict[str, int] = field(default_factory=dict)
    """Requests the gateway refused itself, by reason (``auth``, ``budget_exhausted`` …)."""
    dropped_streams: int = 0
    """Streams the client hung up on (billed for the worst case unless usage was read)."""
    upstream_errors: int = 0
    """Upstream answers with an error status (passed through to the client)."""
    clamped: int = 0
    """Requests whose ``max_tokens`` was lowered to fit what was left of the budget."""
    exhausted: bool = False
    """The budget is spent: the total reached it, or a request was refused for lack of it."""
    cost_usd: float | None = None
    """US dollars charged at the model's prices; None when the model has no price."""
    budget_usd: float | None = None
    """The task's dollar budget, if it has one."""
    reserved_usd: float = 0.0
    """Worst-case dollars held by requests in flight right now."""
    model_error: str = ""
    """The upstream said it has no such model, or retired it (its message), else ""."""
    upstream_failing: int = 0
    """Upstream failures in a row (no answer, a timeout, a 5xx); a success resets it."""
    upstream_error: str = ""
    """The last upstream failure, in words ("" when none)."""
    upstream_down: str = ""
    """Why the gateway gave up on its upstream (after :data:`UPSTREAM_DOWN_AFTER` failures
    in a row), naming the registry entry, the upstream and the error; every later request
    is refused, and the launcher ends the task with this as its error."""

    @property
    def remaining(self) -> float:
        """Budget not yet charged nor reserved."""
        return self.budget - self.weighted_total - self.reserved

    def to_json(self) -> bytes:
        """The usage file's bytes (JSON, one key a line)."""
        return json.dumps(asdict(self), indent=1, ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: Any) -> Usage:
        """Totals from a parsed usage file (unknown keys ignored); :class:`Invalid` if wrong."""
        errors: Errors = []
        values = fields(data, _FIELDS, errors, extra=None)
        if errors:
            raise Invalid(errors)
        return cls(**values)


#: ``(key, checker, default)`` of a usage file.
_FIELDS: tuple[tuple[str, Checker, Any], ...] = (
    ("model", text, ""),
    ("input", integer, 0),
    ("output", integer, 0),
    ("cache_creation", integer, 0),
    ("cache_read", integer, 0),
    ("weighted_total", number, 0.0),
    ("budget", integer, 0),
    ("reserved", number, 0.0),
    ("requests", integer, 0),
    ("refusals", mapping_of(integer), dict),
    ("dropped_streams", integer, 0),
    ("upstream_errors", integer, 0),
    ("clamped", integer, 0),
    ("exhausted", boolean, False),
    ("cost_usd", optional(number), None),
    ("budget_usd", optional(number), None),
    ("reserved_usd", number, 0.0),
    ("cache_creation_1h", integer, 0),
    ("model_error", text, ""),
    ("upstream_failing", integer, 0),
    ("upstream_error", text, ""),
    ("upstream_down", text, ""),
)


def write_usage(path: Path, usage: Usage, *, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``usage`` atomically (temp file in the same dir + ``os.replace``)."""
    write_bytes_atomic(path, usage.to_json(), dir_fd=dir_fd)


def write_bytes_atomic(path: Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same dir + rename).

    ``dir_fd``: an open descriptor of ``path``'s directory, used instead of its path.
    A gateway that dropped its privileges writes through one it opened before: its
    state directory is its own, but the directories above it are not reachable by it.
    """
    name = f".usage-{secrets.token_hex(8)}"
    fd_dir = dir_fd
    if fd_dir is None:
        fd_dir = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=fd_dir
        )
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o644)
                fh.write(data)
            os.replace(name, path.name, src_dir_fd=fd_dir, dst_dir_fd=fd_dir)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd_dir)
            raise
    finally:
        if dir_fd is None:
            os.close(fd_dir)


#: A usage file is a few hundred bytes; anything larger is not one.
_MAX_USAGE_BYTES = 1 << 20


def _open_usage(path: Path) -> int:
    """Open the usage file without following a link its writer could have planted.

    A confined gateway keeps its usage file in a state directory of its own, and
    ``spawn_gateway`` links ``path`` to it (``usage.json -> usage.json.d/usage.json``).
    That one link, made by the launcher in a directory the gateway cannot write,
    is followed; the file it names is opened with ``O_NOFOLLOW`` (the gateway owns
    that directory and could have put a link or a FIFO there).
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    if path.is_symlink():
        target = path.readlink()
        parts = target.parts
        if target.is_absolute() or len(parts) != 2 or ".." in parts:
            raise OSError(f"unexpected link to {str(target)!r}")
        path = path.parent / target
    return os.open(path, flags)


def read_usage(path: Path) -> Usage:
    """Read a usage file written by a gateway; :class:`GatewayError` if missing or corrupt."""
    try:
        fd = _open_usage(path)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise OSError("not a regular file")
            raw = fh.read(_MAX_USAGE_BYTES + 1)
        if len(raw) > _MAX_USAGE_BYTES:
            raise OSError(f"larger than {_MAX_USAGE_BYTES} bytes")
    except OSError as exc:
        raise GatewayError(f"cannot read usage file {path}: {exc}") from exc
    try:
        return Usage.from_json(json.loads(raw))
    except (ValueError, RecursionError) as exc:
        raise GatewayError(f"usage file {path} is not valid: {exc}") from exc
