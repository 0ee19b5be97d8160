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
the gateway's usage file only. Every string may hold what the agent chose:
print it through :func:`agentbox._text.visible` (the CLI does), frame it for a
model (the MCP server does).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from agentbox._wire import TokenUsage

__all__ = [
    "MAX_EVENTS",
    "MAX_FILE_BYTES",
    "MAX_LINE_BYTES",
    "Event",
    "TestCommand",
    "Transcript",
    "TranscriptPage",
    "event_text",
    "is_test_command",
    "page",
    "parse_agent_jsonl",
    "read_transcript",
    "summary",
]

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
#: The most lines of ``launcher.log`` and ``agent.stderr`` read.
_MAX_SIDE_BYTES = 1 << 20

Kind = Literal["phase", "session", "text", "tool_call", "tool_result", "error", "refusal", "result"]

#: Commands that look like running tests (matched on a Bash command line).
_TEST_RE = re.compile(
    r"(?:^|[\s;&|(/])(?:"
    r"pytest|py\.test|tox|nox|unittest|nosetests|"
    r"(?:npm|pnpm|yarn|bun)\s+(?:run\s+)?test|npx\s+(?:jest|vitest|mocha)|jest|vitest|mocha|"
    r"go\s+test|cargo\s+(?:test|nextest)|make\s+(?:-\S+\s+)*(?:test|check)\b|ctest|"
    r"mvn\s+(?:\S+\s+)*test|gradlew?\s+(?:\S+\s+)*test|rspec|rake\s+test|phpunit|"
    r"mix\s+test|dotnet\s+test|bazel\s+test|meson\s+test|deno\s+test|prove"
    r")(?:$|[\s;&|)])"
)
_EXIT_RE = re.compile(r"^\s*Exit code (-?\d{1,4})\b")


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
    line: int | None = None
    """Its line in ``logs/agent.jsonl`` (where the full text is)."""


class TestCommand(BaseModel):
    """The last command the agent ran that looks like running tests."""

    command: str
    exit_code: int | None = None
    """None: no result came back (the task ended while it ran) or it was not said."""


class Transcript(BaseModel):
    """A task's events and what they add up to."""

    events: list[Event] = Field(default_factory=list)
    tools_run: dict[str, int] = Field(default_factory=dict)
    """Tool calls by tool name."""
    last_test_command: TestCommand | None = None
    turns: int = 0
    """Model turns (distinct assistant messages)."""
    tokens: TokenUsage = Field(default_factory=TokenUsage)
    """As the gateway metered them (never from the model's own text)."""
    refusals: dict[str, int] = Field(default_factory=dict)
    """Requests the gateway refused, by reason."""
    skipped_lines: int = 0
    """Lines of agent.jsonl that were not a usable event (malformed, too long)."""
    truncated: bool = False
    """A cap was hit (file size, event count): some events are missing."""


def _cap(text: str, n: int, *, tail: bool = False) -> str:
    if len(text) <= n:
        return text
    return ("…" + text[-n:]) if tail else (text[:n] + "…")


def _str(v: object, n: int = 200) -> str:
    return _cap(v, n) if isinstance(v, str) else ""


def _iso_time(v: object) -> float | None:
    if not isinstance(v, str) or len(v) > 40:
        return None
    try:
        t = _dt.datetime.fromisoformat(v).timestamp()
    except (ValueError, OverflowError, OSError):
        return None
    return t if 0 < t < 1e11 else None


def is_test_command(command: str) -> bool:
    """Whether a shell command line looks like it runs tests (pytest, npm test, go test…)."""
    return _TEST_RE.search(command[:4000]) is not None


def _content_text(content: object) -> str:
    """A tool_result's content (a string, or text blocks) as one string."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    if isinstance(content, list):
        for block in content[:1000]:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, dict) and block.get("type") == "image":
                parts.append("[image]")
    return "\n".join(parts)


def _tool_input(name: str, inp: object) -> str:
    if isinstance(inp, dict):
        cmd = inp.get("command")
        if name == "Bash" and isinstance(cmd, str):
            return _cap(cmd, MAX_INPUT_CHARS)
        for key in ("file_path", "path", "pattern", "url"):
            if isinstance(inp.get(key), str) and len(inp) <= 2:
                return _cap(inp[key], MAX_INPUT_CHARS)
    try:
        return _cap(json.dumps(inp, ensure_ascii=False, default=str), MAX_INPUT_CHARS)
    except (ValueError, TypeError, RecursionError):
        return ""


class _Parser:
    def __init__(self, max_output: int) -> None:
        self.max_output = max_output
        self.events: list[Event] = []
        self.calls: dict[str, tuple[str, str]] = {}  # tool_use id -> (name, input)
        self.tools_run: dict[str, int] = {}
        self.last_test: TestCommand | None = None
        self.test_id: str | None = None
        self.messages: set[str] = set()
        self.skipped = 0
        self.truncated = False

    def add(self, **kw: Any) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.truncated = True
            return
        self.events.append(Event(seq=len(self.events), source="agent", **kw))

    def line(self, raw: bytes, n: int) -> None:
        try:
            ev = json.loads(raw)
        except (ValueError, RecursionError):
            self.skipped += 1
            return
        if not isinstance(ev, dict):
            self.skipped += 1
            return
        kind = ev.get("type")
        t = _iso_time(ev.get("timestamp"))
        if kind == "assistant":
            self.assistant(ev.get("message"), t, n)
        elif kind == "user":
            self.user(ev.get("message"), t, n)
        elif kind == "system":
            self.system(ev, t, n)
        elif kind == "result":
            self.result(ev, t, n)
        # anything else (tool_progress heartbeats, stream events, unknown) is not an event

    def assistant(self, msg: object, t: float | None, n: int) -> None:
        if not isinstance(msg, dict):
            self.skipped += 1
            return
        mid = msg.get("id")
        if isinstance(mid, str) and len(self.messages) < MAX_EVENTS:
            self.messages.add(mid[:100])
        content = msg.get("content")
        if not isinstance(content, list):
            return
        for block in content[:1000]:
            if not isinstance(block, dict):
                continue
            btype = block.get("type")
            if btype == "text" and isinstance(block.get("text"), str):
                if block["text"].strip():
                    self.add(time=t, kind="text", text=_cap(block["text"], MAX_INPUT_CHARS), line=n)
            elif btype == "tool_use":
                name = _str(block.get("name"), 100) or "?"
                tid = _str(block.get("id"), 100) or None
                inp = _tool_input(name, block.get("input"))
                if len(self.tools_run) < 200 or name in self.tools_run:
                    self.tools_run[name] = self.tools_run.get(name, 0) + 1
                if tid is not None and len(self.calls) < MAX_EVENTS:
                    self.calls[tid] = (name, inp)
                if name == "Bash" and is_test_command(inp):
                    self.last_test = TestCommand(command=inp)
                    self.test_id = tid
                self.add(time=t, kind="tool_call", tool=name, tool_id=tid, input=inp, line=n)

    def user(self, msg: object, t: float | None, n: int) -> None:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            return  # a plain user prompt: the task text, known already
        for block in content[:1000]:
            if not isinstance(block, dict) or block.get("type") != "tool_result":
                continue
            tid = _str(block.get("tool_use_id"), 100) or None
            name, _inp = self.calls.get(tid or "", ("?", ""))
            full = _content_text(block.get("content"))
            is_error = block.get("is_error") is True
            code: int | None = None
            if name == "Bash":
                m = _EXIT_RE.match(full)
                code = int(m.group(1)) if m else (None if is_error else 0)
            if tid is not None and tid == self.test_id and self.last_test is not None:
                self.last_test = self.last_test.model_copy(update={"exit_code": code})
            self.add(time=t, kind="tool_result", tool=name, tool_id=tid, exit_code=code,
                     is_error=is_error, text=_cap(full, self.max_output, tail=True),
                     output_chars=len(full), line=n)  # fmt: skip

    def system(self, ev: dict[str, Any], t: float | None, n: int) -> None:
        sub = _str(ev.get("subtype"), 60)
        if sub == "init":
            tools = ev.get("tools")
            count = len(tools) if isinstance(tools, list) else 0
            text = f"Claude Code started (model {_str(ev.get('model'), 80) or '?'}, {count} tools)"
            self.add(time=t, kind="session", text=text, line=n)
        elif "error" in sub or "retry" in sub:
            err = ev.get("error")
            detail = _str(err, 300) or _str(ev.get("message"), 300)
            if isinstance(err, dict):
                detail = _str(err.get("message"), 300) or _str(err.get("type"), 100)
            self.add(time=t, kind="error", text=f"{sub}: {detail}".rstrip(": "), line=n)

    def result(self, ev: dict[str, Any], t: float | None, n: int) -> None:
        turns = ev.get("num_turns")
        sub = _str(ev.get("subtype"), 60) or "?"
        text = f"{sub}" + (f" after {turns} turns" if isinstance(turns, int) else "")
        if ev.get("is_error") is True:
            why = _str(ev.get("result"), 1000)
            self.add(time=t, kind="error", text=f"Claude Code ended with an error ({text}): {why}",
                     is_error=True, line=n)  # fmt: skip
        else:
            self.add(time=t, kind="result", text=text, line=n)


def _read_lines(path: Path, limit: int) -> tuple[list[bytes], bool]:
    """The first ``limit`` bytes of a regular file, split into lines; whether it was longer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return [], False
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return [], False  # a FIFO or device the agent put there: never read
            data = fh.read(limit + 1)
        except OSError:
            return [], False
    longer = len(data) > limit
    lines = data[:limit].split(b"\n")
    if longer or (lines and lines[-1] != b""):
        lines = lines[:-1]  # a half-written last line is not read yet
    return lines, longer


def parse_agent_jsonl(
    path: Path, *, max_output: int = DEFAULT_OUTPUT_CHARS
) -> tuple[_Parser, bool]:
    """Parse Claude Code's stream-json; never raises on its content."""
    p = _Parser(max_output)
    lines, longer = _read_lines(path, MAX_FILE_BYTES)
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            p.skipped += 1
            continue
        p.line(raw, n)
    p.truncated = p.truncated or longer
    return p, longer


def _launcher_events(path: Path, day: float | None) -> list[Event]:
    lines, _ = _read_lines(path, _MAX_SIDE_BYTES)
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
        out.append(
            Event(seq=0, time=t, source="launcher", kind="phase", text=_cap(m.group(4), 500))
        )
    return out


def _gateway(paths_root: Path) -> tuple[TokenUsage, dict[str, int], list[Event]]:
    from agentbox.errors import AgentboxError
    from agentbox.gateway import read_usage

    try:
        u = read_usage(paths_root / "usage.json")
    except AgentboxError:
        return TokenUsage(), {}, []
    tokens = TokenUsage(input=u.input, output=u.output, cache_creation=u.cache_creation,
                        cache_read=u.cache_read)  # fmt: skip
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
    return tokens, refusals, events


def read_transcript(
    task_root: Path, *, created_at: float | None = None, max_output: int = DEFAULT_OUTPUT_CHARS
) -> Transcript:
    """A task's transcript from its directory (``<data>/tasks/<id>``): the launcher's
    phases, the agent's events and the gateway's refusals, merged in time order."""
    logs = task_root / "logs"
    p, _ = parse_agent_jsonl(logs / "agent.jsonl", max_output=max_output)
    phases = _launcher_events(logs / "launcher.log", created_at)
    tokens, refusals, gw = _gateway(task_root)
    # Agent events without a time (init, result) take their neighbour's: stable order.
    agent = p.events
    start = next((e.time for e in phases if e.text.startswith("running ")), None)
    last: float | None = next((e.time for e in agent if e.time is not None), start)
    for e in agent:
        if e.time is None:
            e.time = last
        else:
            last = e.time
    # Launcher times are whole seconds: a phase after the agent started ("agent exited")
    # sorts at the end of its second, so it never lands before the agent's last events.
    after = {id(e) for e in phases if start is not None and e.time is not None and e.time >= start
             and not e.text.startswith("running ")}  # fmt: skip
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
        refusals=refusals,
        skipped_lines=p.skipped,
        truncated=p.truncated or len(merged) > MAX_EVENTS,
    )


def summary(agent_jsonl: Path) -> dict[str, Any]:
    """``tools_run`` and ``last_test_command`` of a task, for its report."""
    p, _ = parse_agent_jsonl(agent_jsonl, max_output=200)
    return {"tools_run": dict(p.tools_run), "last_test_command": p.last_test}


#: The most events one page carries.
MAX_PAGE = 500


class TranscriptPage(BaseModel):
    """Events ``since`` .. ``next`` of a task's transcript (the launcher's ``transcript`` call)."""

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
    if e.kind == "tool_call":
        shown = f"$ {e.input}" if e.tool == "Bash" else (e.input or "")
        return f"{head} {e.tool} {shown}"
    if e.kind == "tool_result":
        status = f"exit {e.exit_code}" if e.exit_code is not None else (
            "error" if e.is_error else "ok")  # fmt: skip
        lines = e.text.rstrip("\n").splitlines()
        kept = lines if tail_lines is None else lines[-tail_lines:]
        cut = f" (last {len(kept)} of {len(lines)} lines)" if len(kept) < len(lines) else ""
        body = "".join(f"\n    {ln}" for ln in kept)
        return f"{head} -> {e.tool} {status}{cut}{body}"
    label = {"phase": "launcher", "refusal": "gateway refused", "error": "ERROR"}.get(
        e.kind, "agent"
    )
    return f"{head} {label}: {e.text}"
