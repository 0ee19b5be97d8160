"""Claude Code's stream-json (``logs/agent.jsonl``) parsed defensively into events.

The agent controls that file: see :mod:`agentbox.transcript` for the caps and
why nothing here raises on its content.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from agentbox.transcript._model import (
    DEFAULT_OUTPUT_CHARS,
    MAX_EVENTS,
    MAX_FILE_BYTES,
    MAX_INPUT_CHARS,
    MAX_LINE_BYTES,
    Event,
    TestCommand,
)

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


def cap(text: str, n: int, *, tail: bool = False) -> str:
    if len(text) <= n:
        return text
    return ("…" + text[-n:]) if tail else (text[:n] + "…")


def _str(v: object, n: int = 200) -> str:
    return cap(v, n) if isinstance(v, str) else ""


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
            return cap(cmd, MAX_INPUT_CHARS)
        for key in ("file_path", "path", "pattern", "url"):
            if isinstance(inp.get(key), str) and len(inp) <= 2:
                return cap(inp[key], MAX_INPUT_CHARS)
    try:
        return cap(json.dumps(inp, ensure_ascii=False, default=str), MAX_INPUT_CHARS)
    except (ValueError, TypeError, RecursionError):
        return ""


def _written_lines(name: str, inp: object) -> int | None:
    """The lines a Write call writes (its ``content``'s); None for other calls."""
    if name != "Write" or not isinstance(inp, dict) or not isinstance(inp.get("content"), str):
        return None
    content: str = inp["content"]
    return content.count("\n") + (1 if content and not content.endswith("\n") else 0)


class _Parser:
    def __init__(self, max_output: int) -> None:
        self.max_output = max_output
        self.events: list[Event] = []
        self.calls: dict[str, tuple[str, str]] = {}  # tool_use id -> (name, input)
        self.written: dict[str, int] = {}  # a Write's tool_use id -> the lines it wrote
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
        turn: str | None = mid[:100] if isinstance(mid, str) and mid else None
        if turn is not None and len(self.messages) < MAX_EVENTS:
            self.messages.add(turn)
        content = msg.get("content")
        if not isinstance(content, list):
            return
        for block in content[:1000]:
            if not isinstance(block, dict):
                continue
            btype = block.get("type")
            if btype == "text" and isinstance(block.get("text"), str):
                if block["text"].strip():
                    self.add(time=t, kind="text", text=cap(block["text"], MAX_INPUT_CHARS), line=n,
                             message_id=turn)  # fmt: skip
            elif btype == "tool_use":
                name = _str(block.get("name"), 100) or "?"
                tid = _str(block.get("id"), 100) or None
                inp = _tool_input(name, block.get("input"))
                if len(self.tools_run) < 200 or name in self.tools_run:
                    self.tools_run[name] = self.tools_run.get(name, 0) + 1
                if tid is not None and len(self.calls) < MAX_EVENTS:
                    self.calls[tid] = (name, inp)
                    lines = _written_lines(name, block.get("input"))
                    if lines is not None:
                        self.written[tid] = lines
                if name == "Bash" and is_test_command(inp):
                    self.last_test = TestCommand(command=inp)
                    self.test_id = tid
                self.add(time=t, kind="tool_call", tool=name, tool_id=tid, input=inp, line=n,
                         message_id=turn)  # fmt: skip

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
                     is_error=is_error, text=cap(full, self.max_output, tail=True),
                     output_chars=len(full), line=n,
                     written_lines=None if is_error else self.written.get(tid or ""))  # fmt: skip

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


def read_lines(path: Path, limit: int) -> tuple[list[bytes], bool]:
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
    lines, longer = read_lines(path, MAX_FILE_BYTES)
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            p.skipped += 1
            continue
        p.line(raw, n)
    p.truncated = p.truncated or longer
    return p, longer
