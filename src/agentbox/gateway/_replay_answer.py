"""One answer of the replay model, as a Messages API message or its SSE events."""

from __future__ import annotations

import json
from typing import Any

from agentbox.gateway._wire import new_id


def signature(thinking: str) -> str:
    """A stable stand-in for the API's opaque thinking signature (base64, like the real)."""
    import base64
    import hashlib

    return base64.b64encode(hashlib.sha256(thinking.encode()).digest() * 2).decode()


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Answer:
    """One assistant message, ready to send as JSON or as SSE events."""

    def __init__(
        self,
        *,
        model: str,
        blocks: list[dict[str, Any]],
        stop_reason: str,
        usage: dict[str, Any],
        chunk_size: int,
    ) -> None:
        self.id = new_id("msg")
        self.model = model
        self.blocks = blocks
        self.stop_reason = stop_reason
        self.usage = usage
        self.chunk_size = chunk_size

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": self.usage,
        }

    def events(self) -> list[bytes]:
        start_usage = {**self.usage, "output_tokens": min(1, self.usage["output_tokens"])}
        head = {**self.message(), "content": [], "stop_reason": None, "usage": start_usage}
        out = [sse("message_start", {"type": "message_start", "message": head})]
        n = self.chunk_size
        for i, block in enumerate(self.blocks):
            if block["type"] == "text":
                start: dict[str, Any] = {"type": "text", "text": ""}
                text = block["text"]
                deltas = [
                    {"type": "text_delta", "text": text[j : j + n]} for j in range(0, len(text), n)
                ]
            elif block["type"] == "thinking":
                # As the API streams it: the text in thinking_delta events, then the
                # whole signature in one signature_delta just before the block stops.
                start = {"type": "thinking", "thinking": "", "signature": ""}
                text = block["thinking"]
                deltas = [
                    {"type": "thinking_delta", "thinking": text[j : j + n]}
                    for j in range(0, len(text), n)
                ]
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                js = json.dumps(block["input"], separators=(",", ":"))
                deltas = [
                    {"type": "input_json_delta", "partial_json": js[j : j + n]}
                    for j in range(0, len(js), n)
                ]
            out.append(
                sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": start},
                )
            )
            if i == 0:
                out.append(sse("ping", {"type": "ping"}))
            for d in deltas:
                out.append(
                    sse(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": i, "delta": d},
                    )
                )
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        out.append(
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": self.usage["output_tokens"]},
                },
            )
        )
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out
