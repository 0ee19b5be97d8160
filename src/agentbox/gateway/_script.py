"""Replay scripts: the assistant turns the replay model plays, in order.

The format is documented in ``docs/reference/replay-script.md``. A script is
YAML or JSON; which turn answers a request is decided from the request itself
(the number of assistant messages already in the conversation), so a retried
request gets the same turn again and side requests (titles, quota checks) do
not consume the script.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentbox.errors import ConfigError

__all__ = ["InjectedError", "ReplayScript", "ToolUse", "Turn", "TurnUsage", "load_script"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolUse(_Strict):
    """A ``tool_use`` block: Claude Code's real tools take their real input schemas."""

    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    """Fixed id (must then be unique in the script); default: a fresh ``toolu_…`` per answer."""


class Block(_Strict):
    """One content block, for turns that need an explicit order of blocks."""

    text: str | None = None
    tool_use: ToolUse | None = None

    @model_validator(mode="after")
    def _one(self) -> Block:
        if (self.text is None) == (self.tool_use is None):
            raise ValueError("a block has exactly one of text or tool_use")
        return self


class TurnUsage(_Strict):
    """Declared usage; fields left out are computed from the request and the answer."""

    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    cache_creation_input_tokens: int = Field(default=0, ge=0)
    cache_read_input_tokens: int = Field(default=0, ge=0)


class InjectedError(_Strict):
    """An error answered instead of the turn, once per attempt, before the turn is played."""

    status: int = Field(default=529, ge=400, le=599)
    type: str | None = None
    """Anthropic error type; default from the status (529 → overloaded_error …)."""
    message: str = "injected by the replay script"
    retry_after: float | None = Field(default=None, ge=0)
    mid_stream: bool = False
    """Streamed requests: send ``message_start`` then an ``error`` event (HTTP 200)."""


class Turn(_Strict):
    """One assistant answer, or a choice between answers (``branches``)."""

    match: str | None = None
    """Regex searched in the last tool_result (or user) text: a branch is taken only if it
    matches; on a plain turn a mismatch is an assertion failure (400 to the client)."""
    text: str | None = None
    tool_use: list[ToolUse] = Field(default_factory=list)
    content: list[Block] | None = None
    """Explicit block order; otherwise ``text`` first, then ``tool_use`` blocks."""
    stop_reason: str | None = None
    """Default: ``tool_use`` when the turn uses a tool, else ``end_turn``."""
    usage: TurnUsage | None = None
    errors: list[InjectedError] = Field(default_factory=list)
    delay: float = Field(default=0.0, ge=0, le=600)
    """Seconds to wait before answering."""
    chunk_delay: float = Field(default=0.0, ge=0, le=60)
    """Seconds between streamed events."""
    truncate_after: int | None = Field(default=None, ge=0)
    """Streamed: drop the connection after this many events (an upstream that dies)."""
    branches: list[Turn] | None = None

    @field_validator("match")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"bad match regex {v!r}: {exc}") from exc
        return v

    @model_validator(mode="after")
    def _shape(self) -> Turn:
        if self.branches is not None:
            if self.text is not None or self.tool_use or self.content is not None:
                raise ValueError("a turn with branches has no content of its own")
            if not self.branches:
                raise ValueError("branches must not be empty")
        return self

    def blocks(self) -> list[Block]:
        """The content blocks in answer order."""
        if self.content is not None:
            return list(self.content)
        out = [Block(text=self.text)] if self.text is not None else []
        out += [Block(tool_use=t) for t in self.tool_use]
        return out


class ReplayScript(_Strict):
    """A whole replay script."""

    name: str = "replay"
    model: str = "replay"
    """The ``model`` reported in answers when the request's model is not used."""
    main: Literal["tools", "all"] = "tools"
    """Which requests play the script: ``tools`` = requests that offer tools (Claude Code's
    main loop); others are side requests (title, topic, quota checks) and get ``side_reply``.
    ``all``: every request plays the script (plain SDK conversations)."""
    side_reply: str = "OK"
    chunk_size: int = Field(default=24, ge=1)
    """Characters per text delta / input_json_delta when streaming."""
    on_exhausted: Literal["end", "error"] = "end"
    """After the last turn: ``end`` answers a short text with end_turn, ``error`` a 400."""
    default_cwd: str | None = None
    """``{{cwd}}`` when the request names no working directory; None: such a request gets a
    400 (a script must not write to a guessed absolute path on the host)."""
    turns: list[Turn]

    @model_validator(mode="after")
    def _unique_ids(self) -> ReplayScript:
        seen: set[str] = set()

        def walk(turns: list[Turn]) -> None:
            for t in turns:
                for b in t.blocks():
                    if b.tool_use and b.tool_use.id:
                        if b.tool_use.id in seen:
                            raise ValueError(f"tool_use id {b.tool_use.id!r} used twice")
                        seen.add(b.tool_use.id)
                walk(t.branches or [])

        walk(self.turns)
        return self


def load_script(path: Path) -> ReplayScript:
    """Load and validate a replay script (``.json``, else YAML); ConfigError naming the path."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read replay script {path}: {exc}") from exc
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"replay script {path} does not parse: {exc}") from exc
    try:
        return ReplayScript.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"replay script {path} is not valid: {exc}") from exc
