"""The gateway's ASGI app: authenticate, validate, reserve, forward, meter, settle.

Request path (every refusal is an Anthropic-style error and is counted by reason):

1. only ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (404 otherwise);
2. the task's token as ``x-api-key`` or ``Authorization: Bearer``, compared in
   constant time (401);
3. the per-task concurrency cap (429 with ``retry-after``);
4. the body cap, read incrementally (413), a JSON object (400), ``max_tokens`` a
   positive integer, ``stream`` a boolean, ``messages`` a list (400);
5. the request held against the model's allow-lists (:mod:`._policy`): unknown fields
   stripped, anything that would make the upstream reach the network refused (400),
   ``model`` rewritten, the body re-serialised;
6. the budget reservation: a ``max_tokens`` that does not fit what is left is lowered
   to fit (clamped, ``thinking.budget_tokens`` with it); 403 once exhausted, or when
   fewer than ``MIN_OUTPUT_TOKENS`` would be left for the answer;
7. forwarded with an allow-list of headers and the upstream's own key; the
   answer passed back as it arrives (SSE event by event), metered on the way
   (:mod:`._forward`);
8. the reservation settled with the real usage and the usage file replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.core.log import get_logger
from agentbox.errors import BodyTooLarge, PolicyViolation, Refusal
from agentbox.gateway._budget import Ledger, open_group_share
from agentbox.gateway._forward import Forwarding, clamp, printable, serialise
from agentbox.gateway._policy import check_request, filter_betas
from agentbox.gateway._reqlog import RequestLog
from agentbox.gateway._upstream import Pool, make_pool
from agentbox.gateway._usage import write_bytes_atomic, write_usage
from agentbox.gateway._wire import (
    Receive,
    Scope,
    Send,
    header,
    parse_json_object,
    read_body,
    send_error,
)
from agentbox.gateway.registry import ModelEntry
from agentbox.linux.libc import libc

log = get_logger(__name__)

_PATHS = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
_MAX_TOKENS_CAP = 1 << 24
#: At most one usage-file write per this many seconds under load: each costs its writer
#: thread ~0.3 ms of CPU (a rename over the old file; more on a loaded machine), which at
#: 10 ms was 10-18 % of a busy gateway's CPU (bench/gateway.py).
_WRITE_INTERVAL = 0.1


#: Seconds with no request in flight before the heap's free pages go back to the kernel.
IDLE_TRIM_AFTER = 2.0


@dataclass
class GatewayConfig:
    """Everything one gateway needs; built by the CLI from its arguments."""

    token: str
    entry: ModelEntry
    upstream_url: str
    """Base URL of the upstream (``http(s)://host[:port]``); with ``upstream_uds`` the host
    part is nominal and the connection goes to that unix socket."""
    budget: int
    budget_usd: float | None = None
    """A dollar budget at the entry's prices (None: none)."""
    upstream_uds: str | None = None
    upstream_key: str | None = None
    usage_file: Path | None = None
    max_body: int = 32 << 20
    max_held: int = 64 << 20
    """Request bytes held at once across all requests (each body from the moment it is
    read until its answer is done: the forwarded copy stays in memory for a retry);
    a request that would pass it gets 429 (a chunked one counts as ``max_body``)."""
    max_concurrency: int = 16
    connect_timeout: float = 10.0
    read_timeout: float = 600.0


class Gateway(Forwarding):
    """The per-task gateway as an ASGI application."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self._token = cfg.token.encode()
        self._bearer = b"Bearer " + self._token
        self.ledger = Ledger(
            budget=cfg.budget,
            model=cfg.entry.name,
            cache_creation_weight=cfg.entry.cache_creation_weight,
            cache_read_weight=cfg.entry.cache_read_weight,
            cache_creation_1h_weight=cfg.entry.cache_creation_1h_weight,
            price=cfg.entry.price,
            budget_usd=cfg.budget_usd,
        )
        self.inflight = 0
        self.held = 0
        """Request body bytes claimed by requests being read, parsed or forwarded."""
        self.active = 0
        """HTTP requests being handled (tests wait for 0 before reading the usage file)."""
        self._writing = False
        """A usage-file write is running, or the pause after one has not ended."""
        self._in_flight = False
        """A usage-file write is running in the worker thread."""
        self._trim: asyncio.TimerHandle | None = None
        self._dirty = False
        self._pool: Pool | None = None
        self._strip = frozenset(cfg.entry.stripped_fields)
        self._policy = cfg.entry.policy
        self._upstream_auth: list[tuple[str, str]] = []
        if cfg.upstream_key:
            self._upstream_auth.append(("x-api-key", cfg.upstream_key))
            if cfg.entry.kind == "compatible":
                self._upstream_auth.append(("authorization", f"Bearer {cfg.upstream_key}"))
        self._usage_dir_fd: int | None = None
        if cfg.usage_file is not None:
            # Written through this descriptor: a gateway that dropped its privileges
            # can no longer reach its state directory by path.
            self._usage_dir_fd = os.open(
                cfg.usage_file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            )
            self._reqlog = RequestLog(self._usage_dir_fd, cfg.usage_file.parent)
            # A best-of-N group's shared budget, linked here by the launcher (held open).
            self.ledger.shared = open_group_share(self._usage_dir_fd)
        self.write_usage()

    # -- lifecycle ---------------------------------------------------------------------
    def pool(self) -> Pool:
        """The upstream connection pool (created on first use, inside the event loop)."""
        if self._pool is None:
            self._pool = make_pool(
                self.cfg.upstream_url,
                self.cfg.upstream_uds,
                connect_timeout=self.cfg.connect_timeout,
                read_timeout=self.cfg.read_timeout,
            )
        return self._pool

    def prepare_for_drop(self) -> None:
        """Load now what a dropped identity might not be able to read later (the CA bundle)."""
        self.pool().prepare()

    async def aclose(self) -> None:
        """Close the upstream client and write the usage file a last time."""
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None
        for _ in range(500):
            if not self._in_flight:
                break
            await asyncio.sleep(0.01)
        self.write_usage()
        if self._reqlog is not None:
            self._reqlog.close()

    def write_usage(self) -> None:
        """Replace the usage file with the current totals now, on this thread."""
        if self.cfg.usage_file is not None:
            try:
                write_usage(self.cfg.usage_file, self.ledger.usage, dir_fd=self._usage_dir_fd)
            except OSError as exc:
                log.error("cannot write usage file", path=str(self.cfg.usage_file), error=str(exc))

    def usage_changed(self) -> None:
        """Schedule a rewrite of the usage file, off the event loop.

        A rename over an existing file costs ~1 ms on ext4 (it flushes the data
        first), too much to spend on the loop per request. One write runs in a
        worker thread at a time, and none starts within 100 ms of the last one's end;
        changes made meanwhile are written together when that pause ends. So a lone
        request is written at once, writes under load coalesce to at most ~10 per
        second whatever the pattern of requests, and the file lags the ledger by at
        most ~100 ms plus one write. The final state is written on shutdown; the budget
        is enforced from the in-memory ledger, never from this file.
        """
        if self.cfg.usage_file is None:
            return
        if self._writing:
            self._dirty = True
            return
        self._writing = self._in_flight = True
        self._dirty = False
        data = self.ledger.usage.to_json()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(
            None,
            functools.partial(
                write_bytes_atomic, self.cfg.usage_file, data, dir_fd=self._usage_dir_fd
            ),
        )
        fut.add_done_callback(self._written)

    def _written(self, fut: asyncio.Future[None]) -> None:
        self._in_flight = False
        if fut.cancelled():
            self._writing = False
            return
        exc = fut.exception()
        if exc is not None:
            log.error("cannot write usage file", path=str(self.cfg.usage_file), error=str(exc))
        # A pause after every write, not only when changes are already waiting: requests
        # spaced just over one write apart would otherwise each start a write of their own.
        asyncio.get_running_loop().call_later(_WRITE_INTERVAL, self._write_again)

    def _write_again(self) -> None:
        self._writing = False
        if self._dirty:
            try:
                self.usage_changed()
            except RuntimeError:
                # The loop's executor is shut down (the gateway is stopping): aclose
                # writes the final state itself.
                self._writing = False

    @property
    def usage_settled(self) -> bool:
        """No usage file write is running or pending (tests wait for this)."""
        return not self._in_flight and not self._dirty

    # -- ASGI --------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        started = False
        self.ledger.usage.requests += 1
        self.active += 1

        async def tracked(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._handle(scope, receive, tracked)
        except Exception as exc:  # the gateway never crashes on any input
            log.error("unhandled error in the gateway", error=repr(exc), exc_info=True)
            if not started:
                with contextlib.suppress(Exception):
                    await send_error(send, 500, "internal gateway error")
        finally:
            self.usage_changed()
            self.active -= 1
            if self.active == 0:
                self._trim_when_idle()

    def _trim_when_idle(self) -> None:
        """Once no request has been in flight for :data:`IDLE_TRIM_AFTER` seconds, hand
        the heap's free pages back to the kernel (``malloc_trim``): a request's buffers
        (an agent's request body is hundreds of KiB) are freed into glibc's heap, which
        keeps them resident, private to this gateway, for the rest of an idle task."""
        if self._trim is not None:
            self._trim.cancel()
        self._trim = asyncio.get_running_loop().call_later(IDLE_TRIM_AFTER, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        if self.active == 0:
            with contextlib.suppress(OSError, AttributeError):
                libc().malloc_trim(0)

    def _refuse(self, reason: str) -> None:
        self.ledger.refuse(reason)

    def count_refusal(self, reason: str) -> None:
        """Count a connection refused below HTTP (a limit of :mod:`._conn`), on the loop."""
        self.ledger.refuse(reason)
        self.usage_changed()

    def _authorized(self, scope: Scope) -> bool:
        keys = header(scope, b"x-api-key")
        auths = header(scope, b"authorization")
        # Exactly one credential: two of them is ambiguous, and ambiguity is how
        # smuggling starts.
        if len(keys) + len(auths) != 1:
            return False
        if keys:
            return hmac.compare_digest(keys[0], self._token)
        return hmac.compare_digest(auths[0], self._bearer)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _PATHS.get(scope.get("path", ""))
        if route is None or scope.get("method") != "POST":
            self._refuse("not_found")
            await send_error(
                send,
                404,
                "not found: only POST /v1/messages and /v1/messages/count_tokens are served",
            )
            return
        if not self._authorized(scope):
            self._refuse("auth")
            await send_error(send, 401, "invalid x-api-key")
            return
        if self.inflight >= self.cfg.max_concurrency:
            self._refuse("concurrency")
            await send_error(
                send,
                429,
                f"too many concurrent requests (limit {self.cfg.max_concurrency})",
                headers=[(b"retry-after", b"1")],
            )
            return
        self.inflight += 1
        try:
            await self._admitted(route, scope, receive, send)
        finally:
            self.inflight -= 1

    async def _admitted(self, route: str, scope: Scope, receive: Receive, send: Send) -> None:
        lengths = header(scope, b"content-length")
        if lengths:
            try:
                declared = int(lengths[0])
            except ValueError:
                declared = -1
            if declared < 0 or len(set(lengths)) > 1:
                self._refuse("invalid_request")
                await send_error(send, 400, "bad content-length")
                return
            if declared > self.cfg.max_body:
                self._refuse("too_large")
                await send_error(send, 413, f"request body over {self.cfg.max_body} bytes")
                return
        claim = int(lengths[0]) if lengths else self.cfg.max_body
        if self.held + claim > self.cfg.max_held:
            # Memory, not the budget: many large bodies at once would each be held
            # (and one parsed) in this process. The client retries.
            self._refuse("busy")
            await send_error(
                send,
                429,
                f"gateway busy: {self.held} request bytes in flight (limit {self.cfg.max_held})",
                headers=[(b"retry-after", b"1")],
            )
            return
        self.held += claim
        try:
            await self._read_and_forward(route, scope, receive, send)
        finally:
            self.held -= claim

    async def _read_and_forward(
        self, route: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        try:
            body = await read_body(receive, self.cfg.max_body)
        except BodyTooLarge:
            self._refuse("too_large")
            await send_error(send, 413, f"request body over {self.cfg.max_body} bytes")
            return
        except ConnectionResetError:
            self._refuse("client_gone")
            return
        try:
            req = parse_json_object(body)
        except ValueError as exc:
            self._refuse("invalid_request")
            await send_error(send, 400, str(exc))
            return
        body_len = len(body)
        del body  # only the re-serialised request is kept from here on
        problem = self._validate(route, req)
        if problem is not None:
            self._refuse("invalid_request")
            await send_error(send, 400, problem)
            return
        try:
            admitted = check_request(req, self._policy)
            betas: list[str] = []
            if self.cfg.entry.passes_beta:
                values = [v for v in map(printable, header(scope, b"anthropic-beta")) if v]
                betas = filter_betas(values, self._policy)
        except PolicyViolation as exc:
            self._refuse("policy")
            log.debug("request refused by policy", reason=str(exc)[:300])
            await send_error(send, 400, str(exc))
            return
        asked = req.get("model")
        req["model"] = self.cfg.entry.target_model
        for name in self._strip.intersection(req):
            del req[name]
        tools_bytes = 0
        if admitted.tool_references and isinstance(req.get("tools"), list):
            tools_bytes = len(json.dumps(req["tools"]))
        extra = admitted.extra_tokens(self._policy, tools_bytes)
        max_tokens = req.get("max_tokens")
        out = serialise(req)
        if len(out) > self.cfg.max_body:
            # Re-serialising can grow a body (1e15 becomes 1000000000000000.0).
            self._refuse("too_large")
            await send_error(send, 413, f"request body over {self.cfg.max_body} bytes")
            return
        log.debug("request admitted", bytes_in=body_len, bytes_out=len(out))
        if (spent := self.ledger.exhausted_refusal()) is not None:
            self._refuse(spent.reason)
            await send_error(send, 403, str(spent))
            return
        if down := self.ledger.usage.upstream_down:
            # Given up on (``Forwarding.upstream_failed``): a 403, which the agent does not
            # retry, ends the task with this as its error, not at its deadline.
            self._refuse("upstream_down")
            await send_error(send, 403, f"the gateway gave up: {down}")
            return
        if route == "count_tokens":
            await self._count_tokens(scope, out, betas, send)
            return
        assert isinstance(max_tokens, int)  # _validate checked it for this route
        try:
            # A 1-hour cache lifetime anywhere in the body: input may be written for an hour.
            long_cache = b'"1h"' in out
            reservation = self.ledger.reserve(len(out), max_tokens, extra, long_cache=long_cache)
        except Refusal as ref:
            self._refuse(ref.reason)
            await send_error(send, 403, str(ref))
            return
        reservation.asked = asked
        if reservation.clamped:
            # Smaller numbers serialise no longer, so the input estimate (taken on the
            # body before) still bounds this body.
            clamp(req, reservation.max_tokens)
            out = serialise(req)
            log.info(
                "max_tokens clamped to the budget left",
                requested=max_tokens,
                granted=reservation.max_tokens,
            )
        del req
        try:
            await self._forward(scope, out, betas, reservation, receive, send)
        finally:
            # Whatever happened (client gone, cancelled at shutdown, a bug): if nothing
            # settled it, the worst case stays charged.
            self.settle(reservation, None, complete=False)

    @staticmethod
    def _validate(route: str, req: dict[str, Any]) -> str | None:
        if not isinstance(req.get("messages"), list):
            return "messages: a list is required"
        if "stream" in req and not isinstance(req["stream"], bool):
            return "stream: must be a boolean"
        if "system" in req and not isinstance(req["system"], (str, list)):
            return "system: must be a string or a list of blocks"
        if "tools" in req and not isinstance(req["tools"], list):
            return "tools: must be a list"
        if route == "messages":
            mt = req.get("max_tokens")
            if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= _MAX_TOKENS_CAP:
                return f"max_tokens: an integer between 1 and {_MAX_TOKENS_CAP} is required"
        return None
