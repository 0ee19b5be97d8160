"""The launcher's ``/v1/secrets`` wire schema: a user's secrets, set and removed through
the socket, listed without their values.

::

    GET    /v1/secrets[?all=1]          -> SecretList   (all: root only, every owner's)
    PUT    /v1/secrets/{name}  SecretSet -> SecretEntry  (201)
    DELETE /v1/secrets/{name}           -> SecretEntry  (what was removed; no value)

The owner is the connecting process's uid as the kernel reports it (``SO_PEERCRED``),
never a field: a request cannot name another user. ``shared`` is root's alone. An
answer never carries a value, and neither does an error (``SecretNotFound`` is 404
with ``name`` and ``uid``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from agentbox.secrets import MAX_VALUE

__all__ = ["SecretEntry", "SecretList", "SecretSet"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SecretSet(_Wire):
    """A value to store under the caller's uid (re-checked by the store)."""

    value: str = Field(min_length=1, max_length=MAX_VALUE)
    shared: bool = False
    """Root only: every user's tasks may use it when they have none of that name."""

    def __repr__(self) -> str:  # never the value, whoever prints the request
        return f"SecretSet(value=<{len(self.value)} chars>, shared={self.shared})"

    __str__ = __repr__


class SecretEntry(_Wire):
    """One secret as it may be shown: never its value."""

    name: str
    owner_uid: int
    owner_name: str
    set_at: float
    shared: bool


class SecretList(_Wire):
    """The secrets a caller's tasks can use (its own, then root's shared ones)."""

    secrets: list[SecretEntry]
