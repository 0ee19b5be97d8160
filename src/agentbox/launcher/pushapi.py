"""The launcher's ``/v1/tasks/{id}/push`` wire schema: push a finished task's result
branch to its repo's remote and, with ``pr``, open a pull request.

::

    POST /v1/tasks/{id}/push  PushRequest -> PushInfo

The caller must be the task's submitter (or root); the push runs as the repo's
owner, the forge token is the submitter's own secret (``GITHUB_TOKEN`` /
``GITLAB_TOKEN``). Neither the request nor the answer carries a token.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PushInfo", "PushRequest"]

_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PushRequest(_Wire):
    """Which remote, which branch, and whether to open a pull request."""

    remote: str = Field(default="origin", pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
    branch: str | None = Field(default=None, pattern=_NAME)
    """The branch to publish and push (default: the task's, ``agentbox/<id>``)."""
    pr: bool = False
    draft: bool = False
    base: str | None = Field(default=None, pattern=_NAME)
    """The pull request's target branch (default: the repo's default branch on the forge)."""


class PushInfo(_Wire):
    """What was pushed, where, and the pull request (empty ``pull_request``: none asked)."""

    task_id: str
    branch: str
    commit: str
    remote: str
    remote_url: str
    """The remote's URL with any user name or password in it removed."""
    pushed: bool
    """False: the remote already had the branch at the result."""
    pull_request: str = ""
    number: int | None = None
    existed: bool = False
    """The pull request was already open (from an earlier publish)."""
