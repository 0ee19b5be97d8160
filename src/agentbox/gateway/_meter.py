"""Reading token usage out of Messages API responses, plain and streamed.

The stream meter sees every chunk the gateway passes on, splits it into SSE
events incrementally, and JSON-parses only the few events that carry usage
(``message_start``, ``message_delta``) or end the message, so metering costs
little on long streams of deltas. Numbers that are not non-negative integers
are treated as unknown: the budget then charges the worst case.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: One C-level search per event (a generator over four names cost ~3 % of the gateway's CPU).
_INTERESTING = re.compile(rb"message_start|message_delta|message_stop|error")
#: An SSE event bigger than this is not buffered for metering (deltas only; usage is tiny).
_MAX_EVENT = 1 << 20


@dataclass
class TokenCount:
    """Token counts as the upstream reported them; None where it did not say."""

    input: int | None = None
    output: int | None = None
    cache_creation: int = 0
    """All cache writes (``cache_creation_input_tokens``), 1-hour ones included."""
    cache_read: int = 0
    cache_creation_1h: int = 0
    """1-hour cache writes (``cache_creation.ephemeral_1h_input_tokens``), priced apart."""

    def update(self, usage: Any) -> None:
        """Take the counts present in an Anthropic ``usage`` object (later values win)."""
        if not isinstance(usage, dict):
            return
        for key, attr in (
            ("input_tokens", "input"),
            ("output_tokens", "output"),
            ("cache_creation_input_tokens", "cache_creation"),
            ("cache_read_input_tokens", "cache_read"),
        ):
            v = usage.get(key)
            if _count(v):
                setattr(self, attr, v)
        split = usage.get("cache_creation")
        hour = split.get("ephemeral_1h_input_tokens") if isinstance(split, dict) else None
        if isinstance(hour, int) and _count(hour):
            self.cache_creation_1h = hour
            # An upstream reporting only the split: the total is at least the 1-hour part.
            self.cache_creation = max(self.cache_creation, hour)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40


def usage_from_message(body: bytes) -> TokenCount | None:
    """The usage of a non-streamed response body; None if it has none we can read."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("usage"), dict):
        return None
    count = TokenCount()
    count.update(doc["usage"])
    if count.input is None or count.output is None:
        return None
    return count


def message_meta(body: bytes) -> tuple[object, object, object]:
    """A non-streamed response's ``id``, ``model`` and ``stop_reason`` (unchecked values)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None, None, None
    if not isinstance(doc, dict):
        return None, None, None
    return doc.get("id"), doc.get("model"), doc.get("stop_reason")


class StreamMeter:
    """Incremental SSE reader that collects usage from a Messages API stream."""

    def __init__(self) -> None:
        self.count = TokenCount()
        self.started = False
        """``message_start`` was seen (input and cache counts are known)."""
        self.finished = False
        """``message_stop`` was seen: the counts are final."""
        self.delta_seen = False
        """A ``message_delta`` with usage was seen (output count is final for the message)."""
        self.error: str | None = None
        """The type of an ``error`` event in the stream, if one came."""
        self.message_id: object = None
        """``message_start``'s ``message.id`` as sent (unchecked: the ledger checks it)."""
        self.model: object = None
        self.stop_reason: object = None
        """``message_delta``'s ``delta.stop_reason`` as sent."""
        self._buf = b""
        self._skipping = False

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the stream as passed to the client.

        The chunk's complete events are searched at once (C-level finds over all of them):
        only an event holding ``message_`` or ``error`` is cut out, and parsed if it names
        one of :data:`_INTERESTING`, so a chunk of deltas costs a few finds whatever its
        number of events."""
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        last = buf.rfind(b"\n\n")  # the end of the last complete event
        if last >= 0:
            start = 0
            if self._skipping:  # the rest of a huge event: not usage
                self._skipping = False
                start = buf.find(b"\n\n") + 2
            find, rfind = buf.find, buf.rfind
            while start <= last:
                # The next event naming one: two memchr-fast finds (the regex's alternation
                # tried each name at every byte: ~4 % of a streamed request's CPU).
                at = find(b"message_", start, last)
                err = find(b"error", start, last if at < 0 else at)
                if err >= 0:
                    at = err
                elif at < 0:
                    break
                begin = rfind(b"\n\n", start, at)
                end = find(b"\n\n", at)  # found: at ``last`` at the latest
                self._event(buf[start if begin < 0 else begin + 2 : end])
                start = end + 2
            rest = buf[last + 2 :]
        else:
            rest = buf
        if len(rest) > _MAX_EVENT:
            # A huge event (a long delta): not usage. Skip to its end without buffering it.
            self._skipping = True
            rest = b""
        self._buf = rest

    def _event(self, raw: bytes) -> None:
        if _INTERESTING.search(raw) is None:
            return
        data_lines = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                data_lines.append(line[5:].lstrip(b" "))
        if not data_lines:
            return
        try:
            doc = json.loads(b"\n".join(data_lines))
        except (ValueError, RecursionError):
            return
        if not isinstance(doc, dict):
            return
        kind = doc.get("type")
        if kind == "message_start":
            self.started = True
            msg = doc.get("message")
            if isinstance(msg, dict):
                self.count.update(msg.get("usage"))
                self.message_id, self.model = msg.get("id"), msg.get("model")
        elif kind == "message_delta":
            delta = doc.get("delta")
            if isinstance(delta, dict) and "stop_reason" in delta:
                self.stop_reason = delta["stop_reason"]
            if isinstance(doc.get("usage"), dict):
                self.delta_seen = True
                self.count.update(doc["usage"])
        elif kind == "message_stop":
            self.finished = True
        elif kind == "error":
            err = doc.get("error")
            self.error = str(err.get("type")) if isinstance(err, dict) else "error"
