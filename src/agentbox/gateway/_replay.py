"""The replay model: a scripted Messages API server.

It speaks the API faithfully enough for the official SDK and Claude Code:
``POST /v1/messages`` (plain JSON or SSE with ``message_start``,
``content_block_start``/``delta``/``stop`` for text and ``tool_use`` with
``input_json_delta``, ``ping``, ``message_delta`` with ``stop_reason`` and usage,
``message_stop``), ``POST /v1/messages/count_tokens``, and errors in
Anthropic's shape. Which turn answers is computed from the request (assistant
messages so far), so retries replay the same turn and side requests (title or
topic generation, quota checks: requests that offer no tools) get a short
canned answer without consuming the script.

It doubles as the tests' recording upstream: with ``log_path`` each request's
path, headers and body are appended to a JSONL file.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from agentbox.core.log import get_logger
from agentbox.errors import BodyTooLarge
from agentbox.gateway._replay_answer import Answer, signature, sse
from agentbox.gateway._script import Block, InjectedError, ReplayScript, Turn
from agentbox.gateway._wire import (
    Receive,
    Scope,
    Send,
    error_body,
    new_id,
    parse_json_object,
    read_body,
    send_error,
    send_json,
)

log = get_logger(__name__)

_CWD_RE = re.compile(r"(?:Primary working directory|Working directory):\s*(\S+)")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def _text_of(content: Any) -> str:
    """The text of a message's content (a string, or blocks with text / tool_result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif block.get("type") == "tool_result":
            parts.append(_text_of(block.get("content")))
    return "\n".join(parts)


def _last_result_text(messages: list[Any]) -> str:
    """What the last user message says: its tool results if any, else its text."""
    for msg in reversed(messages):
        if not isinstance(msg, dict) or msg.get("role") != "user":
            continue
        content = msg.get("content")
        if isinstance(content, list):
            results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
            if results:
                return _text_of(results)
        return _text_of(content)
    return ""


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    return _text_of(system) if isinstance(system, list) else ""


def _find_cwd(req: dict[str, Any]) -> str | None:
    """The working directory Claude Code states (system prompt or a system message)."""
    texts = [_system_text(req.get("system"))]
    texts += [
        _text_of(m.get("content"))
        for m in req.get("messages", [])
        if isinstance(m, dict) and m.get("role") in ("system", "user")
    ]
    for text in texts:
        m = _CWD_RE.search(text)
        if m:
            return m.group(1)
    return None


def _template(value: Any, cwd: str | None) -> Any:
    if cwd is None:
        if "{{cwd}}" in json.dumps(value):
            raise _NoCwd
        return value
    if isinstance(value, str):
        return value.replace("{{cwd}}", cwd)
    if isinstance(value, list):
        return [_template(v, cwd) for v in value]
    if isinstance(value, dict):
        return {k: _template(v, cwd) for k, v in value.items()}
    return value


class _NoCwd(Exception):
    """The script uses ``{{cwd}}`` but the request names no working directory."""


class ReplayModel:
    """ASGI app serving a :class:`ReplayScript`."""

    def __init__(
        self, script: ReplayScript, *, log_path: Path | None = None, max_body: int = 64 << 20
    ) -> None:
        self.script = script
        self.log_path = log_path
        self.max_body = max_body
        self._attempts: dict[tuple[int, ...], int] = defaultdict(int)
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if scope.get("method") != "POST" or path not in (
            "/v1/messages",
            "/v1/messages/count_tokens",
        ):
            await send_error(send, 404, f"no route {scope.get('method')} {path}")
            return
        try:
            body = await read_body(receive, self.max_body)
        except BodyTooLarge:
            await send_error(send, 413, "request body too large")
            return
        except ConnectionResetError:
            return
        try:
            req = parse_json_object(body)
        except ValueError as exc:
            await send_error(send, 400, str(exc))
            return
        if self.log_path is not None:
            self._record(scope, req)
        if path.endswith("/count_tokens"):
            await send_json(
                send, 200, json.dumps({"input_tokens": max(1, len(body) // 4)}).encode()
            )
            return
        try:
            await self._messages(req, len(body), send)
        except _NoCwd:
            await send_error(
                send,
                400,
                f"replay script {self.script.name!r} uses {{{{cwd}}}} but the request "
                "names no working directory (set default_cwd in the script)",
            )

    def _record(self, scope: Scope, req: dict[str, Any]) -> None:
        assert self.log_path is not None
        entry = {
            "path": scope.get("path"),
            "query": scope.get("query_string", b"").decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "body": req,
        }
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(entry) + "\n")

    async def _messages(self, req: dict[str, Any], body_len: int, send: Send) -> None:
        messages = req.get("messages")
        max_tokens = req.get("max_tokens")
        if not isinstance(messages, list) or not messages:
            await send_error(send, 400, "messages: a non-empty list is required")
            return
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            await send_error(send, 400, "max_tokens: a positive integer is required")
            return
        stream = req.get("stream", False) is True
        model = req["model"] if isinstance(req.get("model"), str) else self.script.model
        tools = req.get("tools")
        main = self.script.main == "all" or (isinstance(tools, list) and len(tools) > 0)
        cwd = _find_cwd(req) or self.script.default_cwd
        self.served += 1
        if not main:
            await self._answer(
                send,
                stream,
                self._build(model, [Block(text=self.script.side_reply)], None, None, body_len, cwd),
                None,
            )
            return
        index = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        if index >= len(self.script.turns):
            if self.script.on_exhausted == "error":
                await send_error(
                    send, 400, f"replay script {self.script.name!r} has no turn {index}"
                )
                return
            blocks = [Block(text="(The replay script has no more turns.)")]
            await self._answer(
                send, stream, self._build(model, blocks, "end_turn", None, body_len, cwd), None
            )
            return
        turn = self.script.turns[index]
        key: tuple[int, ...] = (index,)
        last = _last_result_text(messages)
        if turn.branches is not None:
            chosen = next(
                (
                    i
                    for i, b in enumerate(turn.branches)
                    if b.match is None or re.search(b.match, last)
                ),
                None,
            )
            if chosen is None:
                await send_error(
                    send,
                    400,
                    f"replay script {self.script.name!r} turn {index}: no branch "
                    f"matches the last tool result {last[:300]!r}",
                )
                return
            turn = turn.branches[chosen]
            key = (index, chosen)
        elif turn.match is not None and not re.search(turn.match, last):
            await send_error(
                send,
                400,
                f"replay script {self.script.name!r} turn {index}: expected the last "
                f"tool result to match {turn.match!r}, got {last[:300]!r}",
            )
            return
        self._attempts[key] += 1
        attempt = self._attempts[key]
        injected = turn.errors[attempt - 1] if attempt <= len(turn.errors) else None
        if turn.delay:
            await asyncio.sleep(turn.delay)
        answer = self._build(model, turn.blocks(), turn.stop_reason, turn, body_len, cwd)
        if injected is not None and not (injected.mid_stream and stream):
            headers = []
            if injected.retry_after is not None:
                headers.append((b"retry-after", f"{injected.retry_after:g}".encode()))
            await send_error(send, injected.status, injected.message, injected.type, headers)
            return
        await self._answer(send, stream, answer, turn, injected)

    def _build(
        self,
        model: str,
        blocks: list[Block],
        stop_reason: str | None,
        turn: Turn | None,
        body_len: int,
        cwd: str | None,
    ) -> Answer:
        out: list[dict[str, Any]] = []
        chars = 0
        for b in blocks:
            if b.text is not None:
                text = _template(b.text, cwd)
                out.append({"type": "text", "text": text})
                chars += len(text)
            elif b.thinking is not None:
                out.append({"type": "thinking", "thinking": b.thinking,
                            "signature": b.signature or signature(b.thinking)})  # fmt: skip
                chars += len(b.thinking)  # thinking is billed as output
            elif b.tool_use is not None:
                inp = _template(b.tool_use.input, cwd)
                out.append(
                    {
                        "type": "tool_use",
                        "id": b.tool_use.id or new_id("toolu"),
                        "name": b.tool_use.name,
                        "input": inp,
                    }
                )
                chars += len(json.dumps(inp))
        if stop_reason is None:
            stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in out) else "end_turn"
        declared = turn.usage if turn is not None else None
        usage: dict[str, Any] = {
            "input_tokens": max(1, body_len // 4),
            "output_tokens": max(1, chars // 4),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        if declared is not None:
            if declared.input_tokens is not None:
                usage["input_tokens"] = declared.input_tokens
            if declared.output_tokens is not None:
                usage["output_tokens"] = declared.output_tokens
            usage["cache_creation_input_tokens"] = declared.cache_creation_input_tokens
            usage["cache_read_input_tokens"] = declared.cache_read_input_tokens
            if declared.cache_creation_1h_input_tokens:
                hour = declared.cache_creation_1h_input_tokens
                usage["cache_creation_input_tokens"] = max(
                    declared.cache_creation_input_tokens, hour
                )
                split = {
                    "ephemeral_5m_input_tokens": usage["cache_creation_input_tokens"] - hour,
                    "ephemeral_1h_input_tokens": hour,
                }
                usage["cache_creation"] = split
        return Answer(
            model=model,
            blocks=out,
            stop_reason=stop_reason,
            usage=usage,
            chunk_size=self.script.chunk_size,
        )

    async def _answer(
        self,
        send: Send,
        stream: bool,
        answer: Answer,
        turn: Turn | None,
        injected: InjectedError | None = None,
    ) -> None:
        if not stream:
            await send_json(send, 200, json.dumps(answer.message()).encode())
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        events = answer.events()
        if injected is not None:
            # An error after the stream started: HTTP 200, then an ``error`` event.
            err = json.loads(error_body(injected.status, injected.message, injected.type))
            events = [events[0], sse("error", {"type": "error", "error": err["error"]})]
        limit = turn.truncate_after if turn is not None else None
        if limit is not None:
            events = events[:limit]
        delay = turn.chunk_delay if turn is not None else 0.0
        # One write per event, as the real API flushes them: clients and the gateway
        # must cope with events arriving one by one.
        for ev in events:
            await send({"type": "http.response.body", "body": ev, "more_body": True})
            if delay:
                await asyncio.sleep(delay)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
