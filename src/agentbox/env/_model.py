"""What the report says about a task's environment: the setup phase and its egress."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class EnvInfo(BaseModel):
    """One frozen environment as ``agentbox env ls`` shows it."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    key: str
    image: str
    commands: list[str] = Field(default_factory=list)
    inputs: list[str] = Field(default_factory=list)
    """The input files that keyed it (repo-relative paths)."""
    roots: list[str] = Field(default_factory=list)
    """The directories setup created, relative to ``/workspace`` (``.venv``, ``node_modules``)."""
    keep: list[str] = Field(default_factory=list)
    """``[setup] keep`` paths (relative to ``$HOME``) it holds under ``.agentbox-keep``."""
    user: int | None = None
    """The uid whose task made it (None: shared across users)."""
    repo: str = ""
    """The repo whose setup made it (``uid:/real/path``)."""
    files: int = 0
    size: int = 0
    """Bytes of its regular files."""
    created_at: float = 0.0
    last_used: float = 0.0
    uses: int = 0


class SetupReport(BaseModel):
    """The environment part of a task's report (``report.json`` key ``setup``).

    ``cache`` is ``hit`` (a frozen environment was mounted; setup did not run) or
    ``miss`` (setup ran and its result was frozen) or ``failed`` (setup ran and
    failed: no agent started). ``output_tail`` is the end of the setup log: text
    a command in the sandbox chose, shown only through the CLI's sanitizer.
    """

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    cache: Literal["hit", "miss", "failed"]
    key: str
    ran: bool
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    output_tail: str = ""
    roots: list[str] = Field(default_factory=list)
    files: int = 0
    size: int = 0
    dropped: list[str] = Field(default_factory=list)
    """Files setup wrote outside the directories it created: not part of the
    environment, removed before the agent ran (at most 50 named)."""
    killed: str | None = None
    """Why setup died of a signal (an exit code above 128): its deadline, a cancel,
    an OOM kill, or none of ours."""

    @property
    def exit_words(self) -> str:
        """``exit 1``, or ``exit 137: killed by SIGKILL (out of memory: …)``."""
        from agentbox.core.exitwords import exit_words

        return exit_words(self.exit_code, self.killed)

    tracked_changed: list[str] = Field(default_factory=list)
    """Files the workspace held before setup that setup changed or removed (at most 50
    named): such a setup fails the task (see :mod:`agentbox.env._tracked`)."""
    egress: dict[str, Any] | None = None
    """The setup proxy's :class:`~agentbox.egress.EgressSummary` (None: no proxy ran)."""
