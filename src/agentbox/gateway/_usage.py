"""The usage file: the gateway's running totals, read by the launcher.

The gateway rewrites it atomically (a temp file in the same directory, then
``os.replace``) after every request, so a reader never sees half a file.
Nobody parses model output to learn what a task spent: this file is the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from agentbox.errors import GatewayError

__all__ = ["Usage", "read_usage", "write_bytes_atomic", "write_usage"]


class Usage(BaseModel):
    """Running totals of one task's gateway (all token counts as the upstream reported them)."""

    model: str = ""
    """The registry name of the task's model."""
    input: int = 0
    """Uncached input tokens."""
    output: int = 0
    cache_creation: int = 0
    cache_read: int = 0
    weighted_total: float = 0.0
    """What the budget is charged: input + output + cache tokens times their weights."""
    budget: int = 0
    reserved: float = 0.0
    """Worst-case tokens held by requests in flight right now."""
    requests: int = 0
    """Requests answered (any status), count_tokens included."""
    refusals: dict[str, int] = Field(default_factory=dict)
    """Requests the gateway refused itself, by reason (``auth``, ``budget_exhausted`` …)."""
    dropped_streams: int = 0
    """Streams the client hung up on (billed for the worst case unless usage was read)."""
    upstream_errors: int = 0
    """Upstream answers with an error status (passed through to the client)."""
    exhausted: bool = False
    """The budget is spent: the total reached it, or a request was refused for lack of it."""

    @property
    def remaining(self) -> float:
        """Budget not yet charged nor reserved."""
        return self.budget - self.weighted_total - self.reserved


def write_usage(path: Path, usage: Usage) -> None:
    """Replace ``path`` with ``usage`` atomically (temp file in the same dir + ``os.replace``)."""
    write_bytes_atomic(path, usage.model_dump_json(indent=1).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same dir + rename)."""
    fd, name = tempfile.mkstemp(prefix=".usage-", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_usage(path: Path) -> Usage:
    """Read a usage file written by a gateway; :class:`GatewayError` if missing or corrupt."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise GatewayError(f"cannot read usage file {path}: {exc}") from exc
    try:
        return Usage.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise GatewayError(f"usage file {path} is not valid: {exc}") from exc
