"""The transcript: what the agent ran and what came back, as typed events.

Claude Code's stream-json (``logs/agent.jsonl``), the launcher's phases
(``logs/launcher.log``) and the gateway's own metering (``usage.json``: tokens
and refusals) are parsed here ONCE into :class:`Transcript`; ``agentbox logs``,
``--json``, the MCP ``result``/``transcript`` tools and the report's
``tools_run``/``last_test_command`` all read that model.

The agent controls ``agent.jsonl`` (any process in the sandbox can write to
Claude Code's stdout), so the parser is defensive: it reads at most
:data:`MAX_FILE_BYTES`, skips lines over :data:`MAX_LINE_BYTES`, lines that are
not JSON objects (deep nesting included) and events of unknown shape, keeps at
most :data:`MAX_EVENTS` events, caps every text it keeps (a tool's output to
``max_output`` characters, its tail kept; the full text stays in
``agent.jsonl`` at the event's ``line``) and never raises on content. Nothing
is taken from the model's text as a fact about tokens: token counts come from
the gateway's usage file and its request ledger (``requests.jsonl``: one
record per model request, keyed by the upstream's message id, which is the
assistant message id in Claude Code's stream: each turn's first event carries
that turn's tokens). Every string may hold what the agent chose:
print it through :func:`agentbox.core.text.visible` (the CLI does), frame it for a
model (the MCP server does).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

from agentbox.core.wire import TokenUsage
from agentbox.transcript._model import (
    DEFAULT_OUTPUT_CHARS,
    MAX_EVENTS,
    MAX_FILE_BYTES,
    MAX_LINE_BYTES,
    MAX_PAGE,
    Event,
    TestCommand,
    Transcript,
    TranscriptPage,
    TurnTokens,
)
from agentbox.transcript._parse import cap, is_test_command, parse_agent_jsonl, read_lines

__all__ = [
    "MAX_EVENTS",
    "MAX_FILE_BYTES",
    "MAX_LINE_BYTES",
    "Event",
    "TestCommand",
    "Transcript",
    "TranscriptPage",
    "TurnTokens",
    "event_text",
    "is_test_command",
    "page",
    "parse_agent_jsonl",
    "read_transcript",
    "summary",
]

#: The most lines of ``launcher.log`` and ``agent.stderr`` read.
_MAX_SIDE_BYTES = 1 << 20


def _launcher_events(path: Path, day: float | None) -> list[Event]:
    lines, _ = read_lines(path, _MAX_SIDE_BYTES)
    base = time.localtime(day) if day is not None else None
    out: list[Event] = []
    for raw in lines[-2000:]:
        text = raw.decode("utf-8", errors="replace")
        m = re.match(r"(\d\d):(\d\d):(\d\d) (.*)", text)
        if not m:
            continue
        t: float | None = None
        if base is not None and day is not None:
            hh, mm, ss = int(m.group(1)), int(m.group(2)), int(m.group(3))
            with contextlib.suppress(ValueError, OverflowError):
                t = time.mktime((base.tm_year, base.tm_mon, base.tm_mday, hh, mm, ss, 0, 0, -1))
                if t < day - 3600:
                    t += 86400  # past midnight
        out.append(Event(seq=0, time=t, source="launcher", kind="phase", text=cap(m.group(4), 500)))
    return out


def _gateway(paths_root: Path) -> tuple[TokenUsage, dict[str, int], list[Event]]:
    from agentbox.errors import AgentboxError
    from agentbox.gateway import read_usage

    try:
        u = read_usage(paths_root / "usage.json")
    except AgentboxError:
        return TokenUsage(), {}, []
    tokens = TokenUsage(input=u.input, output=u.output, cache_creation=u.cache_creation,
                        cache_read=u.cache_read, cost_usd=u.cost_usd)  # fmt: skip
    when: float | None = None
    with contextlib.suppress(OSError):
        when = (paths_root / "usage.json").stat().st_mtime
    events: list[Event] = []
    refusals = {str(k)[:60]: v for k, v in list(u.refusals.items())[:50] if isinstance(v, int)}
    for why, count in refusals.items():
        text = f"refused {count} request(s): {why}"
        if why == "budget_exhausted" or (why == "budget" and u.exhausted):
            text += f" (budget exhausted after {u.weighted_total:,.0f} of {u.budget:,} tokens)"
        events.append(Event(seq=0, time=when, source="gateway", kind="refusal", text=text))
    if u.upstream_error:
        # One line per count: a follower (`run`, `logs -f`) prints each new one as it comes.
        run = f"{u.upstream_failing} in a row" if u.upstream_failing else "answering since"
        text = (f"upstream of model {u.model} failed ({run}, {u.upstream_errors} errors "
                f"in all); last: {u.upstream_error}")  # fmt: skip
        events.append(Event(seq=0, time=when, source="gateway", kind="error", text=cap(text, 500)))
    if u.upstream_down:
        text = f"gave up on the upstream: {u.upstream_down}"
        events.append(Event(seq=0, time=when, source="gateway", kind="error", text=cap(text, 500)))
    return tokens, refusals, events


def _turn_tokens(task_root: Path, agent: list[Event]) -> list[TurnTokens]:
    """The gateway's request records; each agent turn's first event gets its tokens."""
    from agentbox.gateway import read_requests

    turns: list[TurnTokens] = []
    by_id: dict[str, TurnTokens] = {}
    for r in read_requests(task_root / "usage.json"):
        tokens = TokenUsage(input=r.input, output=r.output, cache_creation=r.cache_creation,
                            cache_read=r.cache_read, cost_usd=r.cost_usd)  # fmt: skip
        turn = TurnTokens(message_id=r.message_id, time=r.time, tokens=tokens, status=r.status,
                          stop_reason=r.stop_reason, complete=r.complete)  # fmt: skip
        turns.append(turn)
        if r.message_id is not None:
            by_id.setdefault(r.message_id, turn)
    for e in agent:
        joined = by_id.get(e.message_id) if e.message_id is not None else None
        if joined is not None and not joined.in_transcript:
            joined.in_transcript = True
            e.tokens = joined.tokens
    return turns


#: Stop reasons said as such in the transcript (others are a turn's ordinary end).
MODEL_STOPS = {
    "refusal": "the model refused to continue (stop_reason refusal)",
    "model_context_window_exceeded": "the model's context window is full "
    "(stop_reason model_context_window_exceeded): the turn was cut off",
}


def _model_stops(turns: list[TurnTokens]) -> list[Event]:
    """An event for each turn the model ended by refusing or on a full context window."""
    return [
        Event(seq=0, time=t.time, source="gateway", kind="stop", text=MODEL_STOPS[t.stop_reason])
        for t in turns
        if t.stop_reason in MODEL_STOPS
    ]


_STARTED = "Claude Code started (model "


def _name_models(agent: list[Event], task_root: Path) -> None:
    """The "Claude Code started (model …)" event names the task's model (and the
    upstream's id), and what the agent asked for when that is neither: the gateway's
    records, not the agent's claim."""
    from agentbox.errors import AgentboxError
    from agentbox.gateway import read_requests, read_usage

    try:
        model = read_usage(task_root / "usage.json").model
    except AgentboxError:
        return
    records = read_requests(task_root / "usage.json")
    upstream = next((r.model for r in records if r.model), "")
    asked = next((r.asked for r in records if r.asked), None)
    for e in agent:
        if e.kind == "session" and e.text.startswith(_STARTED):
            claimed, _, rest = e.text[len(_STARTED) :].partition(", ")
            said = f"{_STARTED}{model}" + (f" = {upstream}" if upstream not in ("", model) else "")
            asked = asked or claimed.rstrip(")")
            if asked and asked not in (model, upstream, "?"):
                said += f"; the agent asked for {asked}"
            e.text = f"{said}, {rest}" if rest else f"{said})"


def read_transcript(
    task_root: Path, *, created_at: float | None = None, max_output: int = DEFAULT_OUTPUT_CHARS
) -> Transcript:
    """A task's transcript from its directory (``<data>/tasks/<id>``): the launcher's
    phases, the agent's events and the gateway's refusals, merged in time order."""
    logs = task_root / "logs"
    p, _ = parse_agent_jsonl(logs / "agent.jsonl", max_output=max_output)
    phases = _launcher_events(logs / "launcher.log", created_at)
    tokens, refusals, gw = _gateway(task_root)
    turn_tokens = _turn_tokens(task_root, p.events)
    gw = [*gw, *_model_stops(turn_tokens)]
    _name_models(p.events, task_root)
    # Agent events without a time (init, result) take their neighbour's: stable order.
    agent = p.events
    running = next((i for i, e in enumerate(phases) if e.text.startswith("running ")), None)
    start = phases[running].time if running is not None else None
    last: float | None = next((e.time for e in agent if e.time is not None), start)
    for e in agent:
        if e.time is None:
            e.time = last
        else:
            last = e.time
        # The agent's times come from the sandbox's clock, which the agent can set (and a
        # guest's can lag): nothing the agent did precedes the launch that started it, so
        # no agent event is shown before the setup that ran first.
        if start is not None and e.time is not None and e.time < start:
            e.time = start
    # Launcher times are whole seconds: a phase after the agent started ("agent exited")
    # sorts at the end of its second, so it never lands before the agent's last events.
    # "After" is by the log's own order, not by time: the phases logged before "running"
    # in the same second stay before it (and the launcher's phases keep their order,
    # which `agentbox run`'s progress counts on: cli._logs._new).
    after = {id(e) for e in phases[running + 1 :]} if running is not None else set()
    inf = float("inf")

    def key(e: Event) -> float:
        if e.time is not None:
            return e.time + (0.999 if id(e) in after else 0.0)
        return start if (e.source == "agent" and start is not None) else inf

    merged = sorted([*phases, *agent, *gw], key=key)
    events = [e.model_copy(update={"seq": i}) for i, e in enumerate(merged[:MAX_EVENTS])]
    return Transcript(
        events=events,
        tools_run=p.tools_run,
        last_test_command=p.last_test,
        turns=len(p.messages),
        tokens=tokens,
        turn_tokens=turn_tokens,
        refusals=refusals,
        skipped_lines=p.skipped,
        truncated=p.truncated or len(merged) > MAX_EVENTS,
    )


def summary(agent_jsonl: Path) -> dict[str, Any]:
    """``tools_run`` and ``last_test_command`` of a task, for its report."""
    p, _ = parse_agent_jsonl(agent_jsonl, max_output=200)
    return {"tools_run": dict(p.tools_run), "last_test_command": p.last_test}


def page(
    task_id: str,
    task_root: Path,
    *,
    since: int = 0,
    limit: int = 200,
    created_at: float | None = None,
    max_output: int = DEFAULT_OUTPUT_CHARS,
) -> TranscriptPage:
    """One page of a task's transcript: events ``since`` onwards, at most ``limit``
    (``since`` < 0: the last ``-since`` events, the tail)."""
    t = read_transcript(task_root, created_at=created_at, max_output=max_output)
    limit = max(1, min(limit, MAX_PAGE))
    total = len(t.events)
    start = max(0, total + since) if since < 0 else min(since, total)
    events = t.events[start : start + limit]
    return TranscriptPage(
        task_id=task_id,
        events=events,
        next=start + len(events),
        total=total,
        tools_run=t.tools_run,
        last_test_command=t.last_test_command,
        tokens=t.tokens,
        refusals=t.refusals,
        skipped_lines=t.skipped_lines,
        truncated=t.truncated,
    )


def event_text(e: Event, *, tail_lines: int | None = 12) -> str:
    """One event as plain text lines (for a model to read: frame it, it is the agent's)."""
    when = time.strftime("%H:%M:%S", time.gmtime(e.time)) + "Z" if e.time is not None else "?"
    head = f"[{e.seq}] {when}"
    if e.tokens is not None:
        t = e.tokens
        head += f" [{t.input + t.cache_creation + t.cache_read:,} in / {t.output:,} out tokens]"
    if e.kind == "tool_call":
        shown = f"$ {e.input}" if e.tool == "Bash" else (e.input or "")
        return f"{head} {e.tool} {shown}"
    if e.kind == "tool_result":
        status = f"exit {e.exit_code}" if e.exit_code is not None else (
            "error" if e.is_error else "ok")  # fmt: skip
        if e.written_lines is not None:  # a Write: what it wrote, not its one-line output
            status += f" (wrote {e.written_lines} line{'' if e.written_lines == 1 else 's'})"
        lines = e.text.rstrip("\n").splitlines()
        kept = lines if tail_lines is None else lines[-tail_lines:]
        cut = f" (last {len(kept)} of {len(lines)} lines)" if len(kept) < len(lines) else ""
        body = "".join(f"\n    {ln}" for ln in kept)
        return f"{head} -> {e.tool} {status}{cut}{body}"
    label = {"phase": "launcher", "refusal": "gateway refused", "error": "ERROR"}.get(
        e.kind, "agent"
    )
    return f"{head} {label}: {e.text}"
