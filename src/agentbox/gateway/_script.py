"""Replay scripts: the assistant turns the replay model plays, in order.

The format is documented in ``docs/reference/replay-script.md``. A script is
YAML or JSON; which turn answers a request is decided from the request itself
(the number of assistant messages already in the conversation), so a retried
request gets the same turn again and side requests (titles, quota checks) do
not consume the script.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentbox.errors import ConfigError
from agentbox.gateway._check import (
    Checker,
    Errors,
    Invalid,
    boolean,
    choice,
    fields,
    integer,
    mapping_of,
    number,
    optional,
    sequence_of,
    text,
)


@dataclass(frozen=True)
class ToolUse:
    """A ``tool_use`` block: Claude Code's real tools take their real input schemas."""

    name: str
    input: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    """Fixed id (must then be unique in the script); default: a fresh ``toolu_…`` per answer."""


@dataclass(frozen=True)
class Block:
    """One content block, for turns that need an explicit order of blocks."""

    text: str | None = None
    tool_use: ToolUse | None = None
    thinking: str | None = None
    """A ``thinking`` block (streamed as ``thinking_delta``, then ``signature_delta``)."""
    signature: str | None = None
    """The thinking block's signature; default: one derived from its text."""


@dataclass(frozen=True)
class TurnUsage:
    """Declared usage; fields left out are computed from the request and the answer."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    """Of the cache writes, those for one hour (``cache_creation.ephemeral_1h_input_tokens``)."""


@dataclass(frozen=True)
class InjectedError:
    """An error answered instead of the turn, once per attempt, before the turn is played."""

    status: int = 529
    type: str | None = None
    """Anthropic error type; default from the status (529 → overloaded_error …)."""
    message: str = "injected by the replay script"
    retry_after: float | None = None
    mid_stream: bool = False
    """Streamed requests: send ``message_start`` then an ``error`` event (HTTP 200)."""


@dataclass(frozen=True)
class Turn:
    """One assistant answer, or a choice between answers (``branches``)."""

    match: str | None = None
    """Regex searched in the last tool_result (or user) text: a branch is taken only if it
    matches; on a plain turn a mismatch is an assertion failure (400 to the client)."""
    text: str | None = None
    tool_use: list[ToolUse] = field(default_factory=list)
    content: list[Block] | None = None
    """Explicit block order; otherwise ``thinking``, then ``text``, then ``tool_use`` blocks."""
    thinking: str | None = None
    """A thinking block before the answer (counted as output tokens, as the API does)."""
    stop_reason: str | None = None
    """Default: ``tool_use`` when the turn uses a tool, else ``end_turn``; also ``refusal``,
    ``model_context_window_exceeded``, ``max_tokens`` …, as the API answers them."""
    usage: TurnUsage | None = None
    errors: list[InjectedError] = field(default_factory=list)
    delay: float = 0.0
    """Seconds to wait before answering (at most 600)."""
    chunk_delay: float = 0.0
    """Seconds between streamed events (at most 60)."""
    truncate_after: int | None = None
    """Streamed: drop the connection after this many events (an upstream that dies)."""
    branches: list[Turn] | None = None

    def blocks(self) -> list[Block]:
        """The content blocks in answer order."""
        if self.content is not None:
            return list(self.content)
        out = [Block(thinking=self.thinking)] if self.thinking is not None else []
        out += [Block(text=self.text)] if self.text is not None else []
        out += [Block(tool_use=t) for t in self.tool_use]
        return out


@dataclass(frozen=True)
class ReplayScript:
    """A whole replay script."""

    turns: list[Turn]
    name: str = "replay"
    model: str = "replay"
    """The ``model`` reported in answers when the request's model is not used."""
    main: Literal["tools", "all"] = "tools"
    """Which requests play the script: ``tools`` = requests that offer tools (Claude Code's
    main loop); others are side requests (title, topic, quota checks) and get ``side_reply``.
    ``all``: every request plays the script (plain SDK conversations)."""
    side_reply: str = "OK"
    chunk_size: int = 24
    """Characters per text delta / input_json_delta when streaming (at least 1)."""
    on_exhausted: Literal["end", "error"] = "end"
    """After the last turn: ``end`` answers a short text with end_turn, ``error`` a 400."""
    default_cwd: str | None = None
    """``{{cwd}}`` when the request names no working directory; None: such a request gets a
    400 (a script must not write to a guessed absolute path on the host)."""


# -- validation (hand-written: the gateway process does not load pydantic) --------


_EXTRA = "is not a key here (check its spelling)"


def _obj(cls: Any, spec: tuple[tuple[str, Checker, Any], ...]) -> Checker:
    """A mapping with exactly ``spec``'s keys, made into ``cls``."""

    def check(value: Any, key: str, errors: Errors) -> Any:
        n = len(errors)
        values = fields(value, spec, errors, prefix=f"{key}." if key else "", extra=_EXTRA)
        return cls(**values) if len(errors) == n else None

    return check


def _str(value: Any, key: str, errors: Errors) -> Any:
    return text(value, key, errors)


def _ge0(value: Any, key: str, errors: Errors) -> Any:
    return integer(value, key, errors, ge=0)


def _seconds(most: float) -> Checker:
    def check(value: Any, key: str, errors: Errors) -> Any:
        return number(value, key, errors, ge=0, le=most)

    return check


def _status(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    out = integer(value, key, errors, ge=400)
    if len(errors) == n and out > 599:
        errors.append((key, "Input should be less than or equal to 599"))
    return out


def _name(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    text(value, key, errors)
    if len(errors) == n and not value:
        errors.append((key, "String should have at least 1 character"))
    return value


def _input(value: Any, key: str, errors: Errors) -> Any:
    return mapping_of(lambda v, _k, _e: v)(value, key, errors)


def _regex(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    text(value, key, errors)
    if len(errors) == n:
        try:
            re.compile(value)
        except re.error as exc:
            errors.append((key, f"bad match regex {value!r}: {exc}"))
    return value


_tool_use = _obj(ToolUse, (("name", _name, ...), ("input", _input, dict),
                           ("id", optional(_str), None)))  # fmt: skip


def _block(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    spec = (
        ("text", optional(_str), None),
        ("tool_use", optional(_tool_use), None),
        ("thinking", optional(_str), None),
        ("signature", optional(_str), None),
    )
    block = _obj(Block, spec)(value, key, errors)
    if len(errors) == n and (block.text, block.tool_use, block.thinking).count(None) != 2:
        errors.append((key, "a block has exactly one of text, tool_use or thinking"))
    elif len(errors) == n and block.signature is not None and block.thinking is None:
        errors.append((key, "signature: only a thinking block has one"))
    return block


_turn_usage = _obj(TurnUsage, (
    ("input_tokens", optional(_ge0), None),
    ("output_tokens", optional(_ge0), None),
    ("cache_creation_input_tokens", _ge0, 0),
    ("cache_read_input_tokens", _ge0, 0),
    ("cache_creation_1h_input_tokens", _ge0, 0),
))  # fmt: skip

_injected = _obj(InjectedError, (
    ("status", _status, 529),
    ("type", optional(_str), None),
    ("message", _str, "injected by the replay script"),
    ("retry_after", optional(_seconds(math.inf)), None),
    ("mid_stream", boolean, False),
))  # fmt: skip


def _turn(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    spec: tuple[tuple[str, Checker, Any], ...] = (
        ("match", optional(_regex), None),
        ("text", optional(_str), None),
        ("tool_use", sequence_of(_tool_use), list),
        ("content", optional(sequence_of(_block)), None),
        ("thinking", optional(_str), None),
        ("stop_reason", optional(_str), None),
        ("usage", optional(_turn_usage), None),
        ("errors", sequence_of(_injected), list),
        ("delay", _seconds(600), 0.0),
        ("chunk_delay", _seconds(60), 0.0),
        ("truncate_after", optional(_ge0), None),
        ("branches", optional(sequence_of(_turn)), None),
    )
    turn = _obj(Turn, spec)(value, key, errors)
    if len(errors) == n and turn.branches is not None:
        if (turn.text is not None or turn.tool_use or turn.content is not None
                or turn.thinking is not None):  # fmt: skip
            errors.append((key, "a turn with branches has no content of its own"))
        elif not turn.branches:
            errors.append((key, "branches must not be empty"))
    return turn


_script = _obj(ReplayScript, (
    ("turns", sequence_of(_turn), ...),
    ("name", _str, "replay"),
    ("model", _str, "replay"),
    ("main", choice("tools", "all"), "tools"),
    ("side_reply", _str, "OK"),
    ("chunk_size", lambda v, k, e: integer(v, k, e, ge=1), 24),
    ("on_exhausted", choice("end", "error"), "end"),
    ("default_cwd", optional(_str), None),
))  # fmt: skip


def _unique_ids(script: ReplayScript) -> str | None:
    seen: set[str] = set()

    def walk(turns: list[Turn]) -> str | None:
        for t in turns:
            for b in t.blocks():
                if b.tool_use and b.tool_use.id:
                    if b.tool_use.id in seen:
                        return f"tool_use id {b.tool_use.id!r} used twice"
                    seen.add(b.tool_use.id)
            if (bad := walk(t.branches or [])) is not None:
                return bad
        return None

    return walk(script.turns)


def check_script(raw: Any) -> ReplayScript:
    """A script from its parsed YAML/JSON; :class:`Invalid` naming each key that is wrong."""
    errors: Errors = []
    script = _script(raw, "", errors)
    if not errors and (bad := _unique_ids(script)) is not None:
        errors.append(("(script)", bad))
    if errors:
        raise Invalid(errors)
    return script  # type: ignore[no-any-return]


def load_script(path: Path) -> ReplayScript:
    """Load and validate a replay script (``.json``, else YAML); ConfigError naming the path."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read replay script {path}: {exc}") from exc
    # yaml only here: a gateway whose upstream is not a replay script never loads it.
    import yaml

    try:
        # libyaml's parser where PyYAML has it (the safe constructors either way): the
        # pure-Python one takes tens of ms of a gateway's start on the demo script.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        raw = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=loader)  # noqa: S506
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"replay script {path} does not parse: {exc}") from exc
    try:
        return check_script(raw)
    except (Invalid, RecursionError) as exc:
        raise ConfigError(f"replay script {path} is not valid: {exc}") from exc
