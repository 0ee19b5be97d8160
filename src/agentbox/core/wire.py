"""Wire types shared by the launcher, collection and the MCP server, below all of them.

:class:`TokenUsage` is the one definition of a task's token counts: the
launcher's wire (``TaskInfo.tokens``), its task store and the collection report
(:class:`agentbox.collect.Report`, where it is also named ``Tokens``) all use
it, so the JSON is the same everywhere. It lives here, not in
:mod:`agentbox.launcher.api` (which re-exports it), so that ``collect`` never
imports the launcher above it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["NO_CHANGES", "TokenUsage", "Wire"]

#: How a finished task whose agent changed nothing is described (CLI, MCP, report).
NO_CHANGES = "no changes: the agent left every file as it was, so no branch was made"


class Wire(BaseModel):
    """Base of every wire model: unknown fields refused, strict types, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TokenUsage(Wire):
    """Tokens metered by the task's gateway, by kind (never parsed from model output)."""

    input: int = 0
    output: int = 0
    cache_creation: int = 0
    cache_read: int = 0
    cost_usd: float | None = None
    """US dollars at the model's registry prices; None: the price is unknown (never $0)."""

    @property
    def total(self) -> int:
        """All tokens of every kind."""
        return self.input + self.output + self.cache_creation + self.cache_read
