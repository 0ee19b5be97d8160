"""The gateway's upstream half: forward an admitted request, pass the answer back, meter it.

:class:`Forwarding` is the part of :class:`~agentbox.gateway._app.Gateway` that
talks to the upstream: the request goes out with an allow-list of headers and the
upstream's own key (never the client's), the answer comes back as it arrives (SSE
event by event, metered on the way by :class:`~._meter.StreamMeter`), upstream
errors are passed on in Anthropic's shape, and the reservation is settled with
what was really used, or the worst case when the stream broke.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from agentbox.core.log import get_logger
from agentbox.errors import UpstreamError, UpstreamTimeout
from agentbox.gateway._budget import Ledger, Reservation
from agentbox.gateway._meter import StreamMeter, TokenCount, message_meta, usage_from_message
from agentbox.gateway._reqlog import RequestLog
from agentbox.gateway._upstream import Pool, UpstreamResponse
from agentbox.gateway._wire import Receive, Scope, Send, error_body, header, send_error, send_json

log = get_logger(__name__)

#: Upstream failures in a row after which the gateway gives up on it and the task ends:
#: Claude Code retries a failed request by itself (with a back-off), so a few failures
#: in a row are an upstream that is down, not a blip.
UPSTREAM_DOWN_AFTER = 4

if TYPE_CHECKING:
    from agentbox.gateway._app import GatewayConfig

_DEFAULT_VERSION = "2023-06-01"
#: Upstream response headers passed back to the client (nothing else is).
_PASS_BACK = (b"retry-after", b"request-id", b"x-request-id")
_MAX_UPSTREAM_BODY = 256 << 20
_MAX_ERROR_BODY = 1 << 20


def printable(value: bytes, limit: int = 1024) -> str | None:
    """A header value safe to forward (printable ASCII, bounded), else None."""
    if len(value) > limit or any(b < 0x20 or b > 0x7E for b in value):
        return None
    return value.decode("ascii")


class Forwarding:
    """The upstream half of the gateway (a base of :class:`~._app.Gateway`)."""

    cfg: GatewayConfig
    ledger: Ledger
    _upstream_auth: list[tuple[str, str]]
    _reqlog: RequestLog | None = None

    def settle(
        self,
        res: Reservation,
        count: TokenCount | None,
        *,
        complete: bool,
        status: int = 0,
        meta: tuple[object, object, object] = (None, None, None),
    ) -> None:
        """Settle ``res`` and append what was charged to the request ledger.

        ``status``: the upstream's HTTP status (0: no answer was read);
        ``meta``: the message's id, model and stop_reason as the upstream sent them.
        """
        if res.settled:
            return
        count = count if count is not None else TokenCount()
        self.ledger.settle(res, count, complete=complete)  # fills in the worst case charged
        if self._reqlog is not None:
            cost = self.ledger.cost(count) if self.ledger.price is not None else None
            self._reqlog.append(message_id=meta[0], model=meta[1], counts=count, status=status,
                                stop_reason=meta[2], complete=complete, asked=res.asked,
                                cost_usd=cost, started=res.started)  # fmt: skip

    def upstream_failed(self, error: str) -> None:
        """Count a failure of the upstream (no answer, a timeout, a 5xx); after
        :data:`UPSTREAM_DOWN_AFTER` in a row, give up on it (``usage.upstream_down``)."""
        u = self.ledger.usage
        u.upstream_failing += 1
        u.upstream_error = "".join(c if c.isprintable() else "?" for c in error[:300])
        log.warning("upstream failed", error=u.upstream_error, in_a_row=u.upstream_failing)
        if u.upstream_failing >= UPSTREAM_DOWN_AFTER and not u.upstream_down:
            e = self.cfg.entry
            u.upstream_down = (
                f"model {e.name!r} ({e.kind}): its upstream {self.cfg.upstream_url} failed "
                f"{u.upstream_failing} times in a row: {u.upstream_error}"
            )

    def upstream_answered(self, status: int) -> None:
        """An answer: a 5xx counts as a failure, anything else ends a run of them."""
        if status >= 500:
            self.upstream_failed(f"answered HTTP {status}")
        else:
            self.ledger.usage.upstream_failing = 0

    def pool(self) -> Pool:
        """The upstream connection pool."""
        raise NotImplementedError

    async def _upstream(
        self, scope: Scope, route: str, body: bytes, betas: list[str]
    ) -> UpstreamResponse:
        return await self.pool().request(
            self._upstream_path(scope, route), self._upstream_headers(scope, betas), body
        )

    def _upstream_headers(self, scope: Scope, betas: list[str]) -> list[tuple[str, str]]:
        hdrs = [("content-type", "application/json"), ("accept-encoding", "identity")]
        version = next((v for v in map(printable, header(scope, b"anthropic-version")) if v), None)
        hdrs.append(("anthropic-version", version or _DEFAULT_VERSION))
        if betas:
            # Only allow-listed values (filter_betas), never the client's header as sent.
            hdrs.append(("anthropic-beta", ",".join(betas)))
        hdrs.extend(self._upstream_auth)
        return hdrs

    def _upstream_path(self, scope: Scope, route: str) -> str:
        path = "/v1/messages" if route == "messages" else "/v1/messages/count_tokens"
        # Only the one query parameter Claude Code sends is forwarded.
        if b"beta=true" in scope.get("query_string", b"").split(b"&"):
            path += "?beta=true"
        return path

    def _reply_headers(self, resp: UpstreamResponse) -> list[tuple[bytes, bytes]]:
        out = []
        for name in _PASS_BACK:
            v = resp.header(name.decode())
            if v is not None:
                safe = printable(v.encode("latin-1", "replace"), 256)
                if safe is not None:
                    out.append((name, safe.encode()))
        return out

    async def _count_tokens(self, scope: Scope, body: bytes, betas: list[str], send: Send) -> None:
        if not self.cfg.entry.has_count_tokens:
            est = self.ledger.estimate_input(len(body))
            await send_json(send, 200, json.dumps({"input_tokens": est}).encode())
            return
        try:
            resp = await self._upstream(scope, "count_tokens", body, betas)
            try:
                content = await self._read_capped(resp, _MAX_ERROR_BODY)
            finally:
                await resp.aclose()
        except UpstreamTimeout as exc:
            self.upstream_failed(f"timed out ({type(exc).__name__})")
            await send_error(send, 504, f"upstream timed out: {type(exc).__name__}")
            return
        except UpstreamError as exc:
            self.upstream_failed(str(exc))
            await send_error(send, 502, f"upstream failed: {exc}")
            return
        self.upstream_answered(resp.status)
        if content is None:
            await send_error(send, 502, "upstream answer too large or broken")
            return
        if not 200 <= resp.status < 300:
            self.ledger.usage.upstream_errors += 1
            await self._send_upstream_error(send, resp.status, content, resp)
            return
        await send_json(send, 200, content, self._reply_headers(resp))

    def _note_model_error(self, status: int, content: bytes) -> None:
        """Record an upstream's "no such model" or "model retired" answer in the usage file:
        the launcher then fails the task naming the registry entry, not the agent."""
        if status not in (400, 404, 410):
            return
        try:
            err = json.loads(content).get("error")
            kind, message = err.get("type"), err.get("message")
        except (ValueError, RecursionError, AttributeError):
            return
        if not isinstance(message, str) or not isinstance(kind, str):
            return
        low = message.lower()
        if kind == "not_found_error" or (
            "model" in low and any(w in low for w in ("deprecat", "retired", "not found",
                                                       "does not exist", "unknown model"))
        ):  # fmt: skip
            self.ledger.usage.model_error = "".join(
                c if c.isprintable() else "?" for c in message[:300]
            )

    async def _send_upstream_error(
        self, send: Send, status: int, content: bytes, resp: UpstreamResponse
    ) -> None:
        """Pass an upstream error on, in Anthropic's shape whatever the upstream sent."""
        try:
            doc = json.loads(content)
            ok = (
                isinstance(doc, dict)
                and doc.get("type") == "error"
                and isinstance(doc.get("error"), dict)
                and isinstance(doc["error"].get("type"), str)
                and isinstance(doc["error"].get("message"), str)
            )
        except (ValueError, RecursionError):
            ok = False
        body = content if ok else error_body(status, f"upstream answered HTTP {status}")
        if not 400 <= status <= 599:
            status = 502
        await send_json(send, status, body, self._reply_headers(resp))

    async def _forward(
        self,
        scope: Scope,
        body: bytes,
        betas: list[str],
        res: Reservation,
        receive: Receive,
        send: Send,
    ) -> None:
        try:
            resp = await self._upstream(scope, "messages", body, betas)
        except UpstreamTimeout as exc:
            self.upstream_failed(f"timed out ({type(exc).__name__})")
            self.ledger.release(res)
            self.ledger.usage.upstream_errors += 1
            await send_error(send, 504, f"upstream timed out: {type(exc).__name__}")
            return
        except UpstreamError as exc:
            self.upstream_failed(str(exc))
            self.ledger.release(res)
            self.ledger.usage.upstream_errors += 1
            await send_error(send, 502, f"upstream failed: {exc}")
            return
        self.upstream_answered(resp.status)
        try:
            if not 200 <= resp.status < 300:
                self.ledger.usage.upstream_errors += 1
                content = await self._read_capped(resp, _MAX_ERROR_BODY)
                self.ledger.release(res)
                self._note_model_error(resp.status, content or b"")
                if self._reqlog is not None:  # not billed: a record of the status only
                    self._reqlog.append(
                        message_id=None,
                        model=None,
                        counts=TokenCount(),
                        status=resp.status,
                        stop_reason=None,
                        complete=True,
                    )
                await self._send_upstream_error(send, resp.status, content or b"", resp)
            elif (resp.header("content-type") or "").startswith("text/event-stream"):
                await self._stream(resp, res, receive, send)
            else:
                content = await self._read_capped(resp, _MAX_UPSTREAM_BODY)
                if content is None:
                    self.settle(res, None, complete=False, status=resp.status)
                    await send_error(send, 502, "upstream answer too large")
                    return
                count = usage_from_message(content)
                self.settle(res, count, complete=count is not None, status=resp.status,
                            meta=message_meta(content))  # fmt: skip
                await send_json(send, resp.status, content, self._reply_headers(resp))
        finally:
            await resp.aclose()

    @staticmethod
    async def _read_capped(resp: UpstreamResponse, limit: int) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    return None
                chunks.append(chunk)
        except UpstreamError:
            return None
        return b"".join(chunks)

    async def _stream(
        self, resp: UpstreamResponse, res: Reservation, receive: Receive, send: Send
    ) -> None:
        meter = StreamMeter()
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *self._reply_headers(resp),
        ]
        head: dict[str, Any] | None = {"type": "http.response.start", "status": 200,
                                       "headers": headers}  # fmt: skip
        ended = False

        async def begin() -> None:
            # The head goes out with the first chunk (one write: CoalescingTransport).
            nonlocal head
            if head is not None:
                start, head = head, None
                await send(start)

        async def pump() -> None:
            nonlocal ended
            async for chunk in resp.aiter_bytes():
                meter.feed(chunk)
                await begin()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if meter.finished:
                # A whole message: end the response in the turn that sent its last chunk,
                # so the terminator leaves in the same write.
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        gone = False

        async def client_gone() -> None:
            # The client hung up: the upstream's connection is dropped, so the pump's
            # read (or its next one) ends at once and the stream is settled as dropped.
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended:
                gone = True
                resp.abort()

        # The pump runs in this task, the watcher in one of its own (no asyncio.wait, no
        # gather: they were ~6 % of a streamed request's CPU in the gateway).
        watching = asyncio.ensure_future(client_gone())
        failed = False
        try:
            await pump()
        except Exception:  # the upstream broke off (or was dropped above)
            failed = True
        finally:
            watching.cancel()
        complete = meter.finished and meter.delta_seen and meter.count.input is not None
        meta = (meter.message_id, meter.model, meter.stop_reason)
        self.settle(res, meter.count, complete=complete, status=resp.status, meta=meta)
        if ended:
            return
        if not gone:
            await begin()
            broke = failed or not meter.finished
            if broke and meter.error is None:
                # The upstream broke off: tell the client in the stream's own terms.
                why = "upstream stream ended before message_stop"
                err = {"type": "error", "error": {"type": "api_error", "message": why}}
                chunk = f"event: error\ndata: {json.dumps(err)}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            self.ledger.usage.dropped_streams += 1


#: The request's encoders, made once (``json.dumps`` with options builds one per call).
_UTF8 = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII = json.JSONEncoder(separators=(",", ":"))


def serialise(req: dict[str, Any]) -> bytes:
    try:
        return _UTF8.encode(req).encode()
    except UnicodeEncodeError:
        # A lone surrogate (valid as a JSON escape, not as UTF-8): keep it escaped.
        return _ASCII.encode(req).encode()


def clamp(req: dict[str, Any], max_tokens: int) -> None:
    """Lower ``req``'s ``max_tokens`` (and a thinking budget that would not fit under it)."""
    req["max_tokens"] = max_tokens
    thinking = req.get("thinking")
    if isinstance(thinking, dict):
        bt = thinking.get("budget_tokens")
        if isinstance(bt, int) and not isinstance(bt, bool) and bt >= max_tokens:
            # The API wants budget_tokens < max_tokens; max_tokens >= MIN_OUTPUT_TOKENS
            # (2048) here, so this stays above thinking's own minimum of 1,024.
            thinking["budget_tokens"] = max_tokens - 1
