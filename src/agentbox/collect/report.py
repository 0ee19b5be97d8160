"""The task report: what the launcher returns to the user, as JSON and as text.

The launcher fills the fields it owns (status, exit code, tokens, duration,
the agent's final message); :meth:`Report.add_collected` fills the rest from a
:class:`~agentbox.collect.Collected`. A task whose agent changed nothing has
``changed: false``, no commit and no branch, and its text says "no changes".

Paths that make other tools run code when the branch is opened or merged
(``.envrc``, ``.claude/``, ``.github/workflows/`` …, see :mod:`._risky`) are
listed in ``flagged``, which the CLI and the MCP result show above the diff.

Every string here may hold text the agent chose (file names, its final
message): print it through :func:`agentbox.core.text.visible`, never as markup.

Token counts use the wire model :class:`~agentbox.core.wire.TokenUsage` (also
:class:`agentbox.launcher.api.TokenUsage`; ``Tokens`` here is the same class),
so the report's ``tokens`` and a task's ``tokens`` are one definition with one
JSON shape.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from agentbox.collect._model import Collected, DiffStat, Skipped
from agentbox.collect._risky import flag_change, risky_reason
from agentbox.core.text import visible
from agentbox.core.wire import NO_CHANGES, TokenUsage
from agentbox.transcript import TestCommand

__all__ = ["Flagged", "Report", "Tokens", "tests_line"]

#: Tokens metered by the gateway, by kind: the launcher's :class:`TokenUsage`, not a copy.
Tokens = TokenUsage


class Flagged(BaseModel):
    """A path in the result that makes another tool run code when the branch is
    opened, checked out or merged; review it before you do."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True, frozen=True)

    path: str
    change: str
    """added | modified | deleted."""
    reason: str
    """Which tool runs what (``direnv runs it in your shell when you cd …``)."""


def _quote(path: str) -> str:
    """``path`` as git's diff header writes it (C-quoted when it holds odd bytes)."""
    raw = os.fsencode(path)
    if not any(b < 0x20 or b >= 0x7F or b in b'"\\' for b in raw):
        return path
    named = {0x07: "a", 0x08: "b", 0x09: "t", 0x0A: "n", 0x0B: "v", 0x0C: "f", 0x0D: "r"}
    out = []
    for b in raw:
        if b in b'"\\':
            out.append("\\" + chr(b))
        elif b in named:
            out.append("\\" + named[b])
        elif b < 0x20 or b >= 0x7F:
            out.append(f"\\{b:03o}")
        else:
            out.append(chr(b))
    return '"' + "".join(out) + '"'


def _in_diff(path: str, headers: set[str]) -> bool:
    q = _quote(path)
    if q.startswith('"'):
        return f'diff --git "a/{q[1:]} "b/{q[1:]}' in headers
    return f"diff --git a/{path} b/{path}" in headers


def flagged_paths(c: Collected) -> list[Flagged]:
    """The flagged paths of a collection: the walk's flag notes, kept only where the
    change reached the commit (checked against the diff when it is complete)."""
    if not c.changed:
        return []
    headers = (
        None
        if c.diff_truncated
        else {ln for ln in c.diff.splitlines() if ln.startswith("diff --git ")}
    )
    out: list[Flagged] = []
    for note in c.notes:
        change = flag_change(note.reason)
        why = risky_reason(note.path)
        if change is None or why is None:
            continue
        if headers is not None and not _in_diff(note.path, headers):
            continue  # touched but left as it was, ignored by .gitignore, or over a cap
        out.append(Flagged(path=note.path, change=change, reason=why))
    return sorted(out, key=lambda f: f.path)


def tests_line(t: TestCommand | dict[str, object] | None) -> str:
    """``last_test_command`` in words: the command and how it exited, or that none ran."""
    if isinstance(t, dict):
        cmd, code = t.get("command"), t.get("exit_code")
    elif t is not None:
        cmd, code = t.command, t.exit_code
    else:
        return "none run (the agent ran no test command)"
    if not isinstance(cmd, str):
        return "none run (the agent ran no test command)"
    how = "exit code unknown" if not isinstance(code, int) else (
        "passed (exit 0)" if code == 0 else f"FAILED (exit {code})")  # fmt: skip
    return f"{how}: {cmd[:200]}"


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
    flagged: list[Flagged] = Field(default_factory=list)
    """Paths in the result that make other tools run code when the branch is opened or
    merged (``.envrc``, ``.claude/``, ``.gitattributes``, ``.github/workflows/`` …)."""
    refused: list[str] = Field(default_factory=list)
    """What the sandbox or gateway refused (the launcher fills this)."""
    final_message: str | None = None
    error: str | None = None
    tools_run: dict[str, int] = Field(default_factory=dict)
    """The agent's tool calls by tool name (from its transcript)."""
    last_test_command: TestCommand | None = None
    """The last command the agent ran that looks like tests (pytest, npm test, go test…)
    and its exit code; None: it ran none ("done, but the tests never ran")."""

    def add_collected(self, c: Collected) -> None:
        """Copy the collection outcome in: changed, commit, branch, diffstat, skipped,
        notes, and the flagged paths (out of the notes, where the walk marks them)."""
        self.base_commit = c.base_commit
        self.changed = c.changed
        self.commit = c.commit or None
        self.branch = c.branch or None
        self.diffstat = c.diffstat
        self.skipped = list(c.skipped)
        self.notes = [n for n in c.notes if flag_change(n.reason) is None]
        self.flagged = flagged_paths(c)

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
        lines.append(f"tests     {tests_line(self.last_test_command)}")
        if self.tools_run:
            runs = ", ".join(f"{k} {v}" for k, v in sorted(self.tools_run.items()))
            lines.append(f"tools     {runs}")
        if self.flagged:
            lines.append("runs code when the branch is opened or merged (review first):")
            lines.extend(f"  {f.change} {f.path}: {f.reason}" for f in self.flagged)
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
        return visible("\n".join(lines)) + "\n"
