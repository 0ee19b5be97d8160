"""The transcript's typed model and its caps (see :mod:`agentbox.transcript`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.core.wire import TokenUsage

#: The most of ``agent.jsonl`` read (its head; a longer file is marked truncated).
MAX_FILE_BYTES = 64 << 20
#: A longer line is skipped (counted in ``skipped_lines``).
MAX_LINE_BYTES = 4 << 20
#: The most events kept (later ones are dropped and the transcript marked truncated).
MAX_EVENTS = 20_000
#: Default cap of a tool's output, in characters (its tail is kept).
DEFAULT_OUTPUT_CHARS = 8_000
#: Cap of a tool call's input and of an agent text block, in characters.
MAX_INPUT_CHARS = 4_000

#: ``stop``: the model ended a turn on its own for a reason worth saying (it refused,
#: its context window was full), from the gateway's request records.
Kind = Literal[
    "phase", "session", "text", "tool_call", "tool_result", "error", "refusal", "result", "stop"
]


class Event(BaseModel):
    """One thing that happened in a task, in order."""

    seq: int
    """Its index in the transcript (``transcript(id, since=seq)`` pages from here)."""
    time: float | None = None
    """Epoch seconds (launcher phases: to the second; events without a time: None)."""
    source: Literal["launcher", "agent", "gateway"]
    kind: Kind
    text: str = ""
    """Phase text, agent text, error text, or a tool result's output (its tail, capped)."""
    tool: str | None = None
    """The tool's name (tool_call; tool_result: the name of the call it answers)."""
    tool_id: str | None = None
    input: str | None = None
    """A tool call's input: the command for Bash, else its JSON (capped)."""
    exit_code: int | None = None
    """A tool result's exit code where known (Bash: 0 unless it says ``Exit code N``)."""
    is_error: bool = False
    output_chars: int | None = None
    """A tool result's full output length; more than ``len(text)`` when it was capped."""
    written_lines: int | None = None
    """A Write's result: the lines the call wrote (its content's), which its one-line
    output ("File created successfully at …") does not say; None for other tools."""
    line: int | None = None
    """Its line in ``logs/agent.jsonl`` (where the full text is)."""
    message_id: str | None = None
    """The assistant message (model turn) a text or tool call came in."""
    tokens: TokenUsage | None = None
    """The turn's tokens as the gateway metered them, on the turn's first event only
    (so summing events counts each turn once); None when the gateway has no record."""


class TurnTokens(BaseModel):
    """One model request as the gateway metered it (``requests.jsonl``, never model text)."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    message_id: str | None = None
    """The upstream's message id: Claude Code's assistant ``message.id`` for an agent turn."""
    time: float | None = None
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    status: int = 0
    """The upstream's HTTP status."""
    stop_reason: str | None = None
    complete: bool = True
    """False: the stream broke and the worst case was charged."""
    in_transcript: bool = False
    """An agent event carries it (else a request Claude Code made on the side)."""


class TestCommand(BaseModel):
    """The last command the agent ran that looks like running tests."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    command: str
    exit_code: int | None = None
    """None: no result came back (the task ended while it ran) or it was not said."""


class Transcript(BaseModel):
    """A task's events and what they add up to."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    events: list[Event] = Field(default_factory=list)
    tools_run: dict[str, int] = Field(default_factory=dict)
    """Tool calls by tool name."""
    last_test_command: TestCommand | None = None
    turns: int = 0
    """Model turns (distinct assistant messages)."""
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    """As the gateway metered them (never from the model's own text)."""
    turn_tokens: list[TurnTokens] = Field(default_factory=list)
    """Every model request the gateway forwarded, in order, with what it cost."""
    refusals: dict[str, int] = Field(default_factory=dict)
    """Requests the gateway refused, by reason."""
    skipped_lines: int = 0
    """Lines of agent.jsonl that were not a usable event (malformed, too long)."""
    truncated: bool = False
    """A cap was hit (file size, event count): some events are missing."""


#: The most events one page carries.
MAX_PAGE = 500


class TranscriptPage(BaseModel):
    """Events ``since`` .. ``next`` of a task's transcript (the launcher's ``transcript`` call)."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    task_id: str
    events: list[Event] = Field(default_factory=list)
    next: int = 0
    """Pass as ``since`` to read on; equal to ``total`` when there is no more yet."""
    total: int = 0
    tools_run: dict[str, int] = Field(default_factory=dict)
    last_test_command: TestCommand | None = None
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    refusals: dict[str, int] = Field(default_factory=dict)
    skipped_lines: int = 0
    truncated: bool = False
