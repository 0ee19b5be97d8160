"""The task report: what the launcher returns to the user, as JSON and as text.

The launcher fills the fields it owns (status, exit code, tokens, duration,
the agent's final message); :meth:`Report.add_collected` fills the rest from a
:class:`~agentbox.collect.Collected`. A task whose agent changed nothing has
``changed: false``, no commit and no branch, and its text says "no changes".

Token counts use the launcher's wire model :class:`~agentbox.launcher.api.TokenUsage`
(``Tokens`` here is the same class), so the report's ``tokens`` and a task's
``tokens`` are one definition with one JSON shape.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from agentbox.collect._model import Collected, DiffStat, Skipped
from agentbox.launcher.api import NO_CHANGES, TokenUsage

__all__ = ["Report", "Tokens"]

#: Tokens metered by the gateway, by kind: the launcher's :class:`TokenUsage`, not a copy.
Tokens = TokenUsage


class Report(BaseModel):
    """One task's outcome. Every field may be absent while the task runs."""

    task_id: str
    status: str = "queued"
    """queued | running | collecting | done | failed | timed_out | cancelled."""
    exit_code: int | None = None
    model: str | None = None
    duration_s: float | None = None
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    budget: int | None = None
    base_commit: str | None = None
    commit: str | None = None
    branch: str | None = None
    changed: bool | None = None
    """Whether the agent changed anything (None: not collected; False: no commit, no branch)."""
    diffstat: DiffStat = Field(default_factory=DiffStat)
    skipped: list[Skipped] = Field(default_factory=list)
    """Paths not collected as the agent left them (devices, FIFOs, oversize, links out…)."""
    notes: list[Skipped] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list)
    """What the sandbox or gateway refused (the launcher fills this)."""
    final_message: str | None = None
    error: str | None = None

    def add_collected(self, c: Collected) -> None:
        """Copy the collection outcome (changed, commit, branch, diffstat, skipped, notes) in."""
        self.base_commit = c.base_commit
        self.changed = c.changed
        self.commit = c.commit or None
        self.branch = c.branch or None
        self.diffstat = c.diffstat
        self.skipped = list(c.skipped)
        self.notes = list(c.notes)

    def to_json(self) -> str:
        """The report as indented JSON."""
        return self.model_dump_json(indent=2)

    def to_text(self) -> str:
        """The report for a terminal: one fact per line, skipped paths listed."""
        lines = [f"task      {self.task_id}", f"status    {self.status}"]
        if self.exit_code is not None:
            lines.append(f"exit code {self.exit_code}")
        if self.model:
            lines.append(f"model     {self.model}")
        if self.duration_s is not None:
            lines.append(f"duration  {self.duration_s:.1f} s")
        t = self.tokens
        budget = f" of {self.budget}" if self.budget else ""
        lines.append(
            f"tokens    {t.total}{budget} (in {t.input}, out {t.output}, "
            f"cache write {t.cache_creation}, cache read {t.cache_read})"
        )
        if self.branch:
            lines.append(f"branch    {self.branch} ({(self.commit or '')[:12]}"
                         f" on {(self.base_commit or '')[:12]})")  # fmt: skip
        lines.append(f"changes   {NO_CHANGES if self.changed is False else self.diffstat}")
        if self.error:
            lines.append(f"error     {self.error}")
        for title, items in (("skipped", self.skipped), ("notes", self.notes)):
            if items:
                lines.append(f"{title}:")
                lines.extend(f"  {s.path}: {s.reason}" for s in items)
        if self.refused:
            lines.append("refused:")
            lines.extend(f"  {r}" for r in self.refused)
        if self.final_message:
            lines.append("agent's final message:")
            lines.extend(f"  {ln}" for ln in self.final_message.strip().splitlines())
        return "\n".join(lines) + "\n"
