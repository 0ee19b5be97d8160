"""The budget ledger: reserve the worst case before forwarding, reconcile after.

All methods run on the gateway's one event loop thread and never await, so a
reservation is checked and taken in one step: concurrent requests cannot
together pass the budget. The invariant is ``charged + reserved <= budget``
whenever the upstream reports no more than it was allowed (input within the
estimate, output within ``max_tokens``); an upstream that reports more is still
charged in full, and the task is then exhausted.

A request whose ``max_tokens`` does not fit what is left is not refused: its
``max_tokens`` is lowered (clamped) to what is left after its input estimate, so
the model stops early and the client carries on or ends. Only when fewer than
:data:`MIN_OUTPUT_TOKENS` output tokens would be left is it refused. The minimum
useful budget is therefore one request's input reservation plus that many tokens.

A task may also have a dollar budget (``budget_usd``), kept the same way at the
model's :class:`~agentbox.gateway._price.Price`: each request reserves its worst case
in dollars beside its worst case in tokens, ``max_tokens`` is clamped to whichever
leaves less, and ``cost_usd + reserved_usd <= budget_usd`` holds as above.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from agentbox.errors import Refusal
from agentbox.gateway._meter import TokenCount
from agentbox.gateway._price import PER, Price, format_usd
from agentbox.gateway._usage import Usage

#: The fewest output tokens a clamped request is given; below that it is refused.
#: More than 1,024 so that extended thinking's minimum budget still fits under it.
MIN_OUTPUT_TOKENS = 2048


@dataclass
class Reservation:
    """Budget held for one request in flight."""

    amount: float
    input_estimate: int
    max_tokens: int
    """The ``max_tokens`` the request may be forwarded with (lowered if clamped)."""
    settled: bool = False
    requested: int = 0
    """The client's ``max_tokens``; above :attr:`max_tokens` when it was clamped."""
    amount_usd: float = 0.0
    """Dollars held (0 without a price)."""
    long_cache: bool = False
    """The request may write 1-hour cache entries (its worst-case input weighs more)."""
    asked: object = None
    """The ``model`` the client asked for (the request log records it)."""
    started: float = field(default_factory=time.time)
    """When the request arrived (the request log's ``started``: a trace's span start)."""

    @property
    def clamped(self) -> bool:
        return self.requested > self.max_tokens


@dataclass
class Ledger:
    """Running totals and the budget of one task."""

    budget: int
    model: str
    cache_creation_weight: float = 1.25
    cache_read_weight: float = 0.1
    cache_creation_1h_weight: float = 2.0
    price: Price | None = None
    """The model's prices; None: cost unknown (and no dollar budget is possible)."""
    budget_usd: float | None = None
    bytes_per_token: float = 1.0
    """Input estimate = body bytes / this. 1.0 never undercounts text: a BPE token
    covers at least one byte, and the JSON body holds all of the prompt's text."""
    overhead_tokens: int = 512
    """Added to every input estimate: tokens the API adds (tool-use system prompt …)."""
    usage: Usage = field(init=False)
    _in_flight: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.usage = Usage(model=self.model, budget=self.budget, budget_usd=self.budget_usd)
        if self.price is not None:
            self.usage.cost_usd = 0.0
        elif self.budget_usd is not None:
            raise ValueError(f"model {self.model!r} has no price: a dollar budget needs one")

    # -- pricing -----------------------------------------------------------------------
    def weigh(self, c: TokenCount) -> float:
        """What ``c`` costs against the budget."""
        five = max(c.cache_creation - c.cache_creation_1h, 0)
        return (
            (c.input or 0)
            + (c.output or 0)
            + five * self.cache_creation_weight
            + c.cache_creation_1h * self.cache_creation_1h_weight
            + c.cache_read * self.cache_read_weight
        )

    def cost(self, c: TokenCount) -> float:
        """What ``c`` costs in dollars (0 without a price)."""
        if self.price is None:
            return 0.0
        return self.price.cost(
            input=c.input or 0,
            output=c.output or 0,
            cache_creation=c.cache_creation,
            cache_creation_1h=c.cache_creation_1h,
            cache_read=c.cache_read,
        )

    def estimate_input(self, body_len: int) -> int:
        """A conservative input token estimate for a request body of ``body_len`` bytes."""
        return math.ceil(body_len / self.bytes_per_token) + self.overhead_tokens

    def _input_weight(self, long_cache: bool = False) -> float:
        # Worst case: every input token turns out to be a cache write (a 1-hour one when
        # the request asks for that lifetime anywhere).
        w = max(1.0, self.cache_creation_weight, self.cache_read_weight)
        return max(w, self.cache_creation_1h_weight) if long_cache else w

    def _input_usd(self, long_cache: bool) -> float:
        """The most one input token can cost in dollars."""
        assert self.price is not None
        p = self.price
        rate = max(p.input, p.write_5m, p.read, p.write_1h if long_cache else 0.0)
        return rate / PER

    @property
    def remaining_usd(self) -> float | None:
        """Dollars neither charged nor reserved; None without a dollar budget."""
        if self.budget_usd is None:
            return None
        return self.budget_usd - (self.usage.cost_usd or 0.0) - self.usage.reserved_usd

    def exhausted_refusal(self) -> Refusal | None:
        """The refusal every request gets once a budget is spent, or None."""
        u = self.usage
        if u.weighted_total >= self.budget:
            u.exhausted = True
            return Refusal(
                "budget_exhausted",
                f"token budget exhausted: {u.weighted_total:.0f} of {self.budget} tokens used",
            )
        if self.budget_usd is not None and (u.cost_usd or 0.0) >= self.budget_usd:
            u.exhausted = True
            return Refusal(
                "budget_exhausted",
                f"dollar budget exhausted: {format_usd(u.cost_usd)} of "
                f"{format_usd(self.budget_usd)} used",
            )
        return None

    @property
    def remaining(self) -> float:
        """Budget neither charged nor reserved."""
        return self.budget - self.usage.weighted_total - self.usage.reserved

    # -- the two steps -----------------------------------------------------------------
    def reserve(
        self, body_len: int, max_tokens: int, extra_input: int = 0, *, long_cache: bool = False
    ) -> Reservation:
        """Hold the worst case of a request, or raise :class:`Refusal` (nothing held).

        ``extra_input``: input tokens the body's bytes do not bound (images, PDFs …,
        counted by the request policy), added to the estimate. ``long_cache``: the
        request may write 1-hour cache entries.
        """
        if (spent := self.exhausted_refusal()) is not None:
            raise spent
        est = self.estimate_input(body_len) + extra_input
        input_cost = est * self._input_weight(long_cache)
        left = self.remaining
        # What is left for output once the worst-case input is held.
        room = math.floor(left - input_cost)
        granted = max_tokens
        if max_tokens > room:
            if room < MIN_OUTPUT_TOKENS:
                if self.usage.reserved == 0:
                    # Nothing else in flight could free budget: this task cannot go on.
                    self.usage.exhausted = True
                raise Refusal(
                    "over_budget",
                    f"token budget exhausted: {self.usage.weighted_total:.0f} of "
                    f"{self.budget} tokens used and {max(left, 0):.0f} left "
                    f"({self.usage.reserved:.0f} held by requests in flight); this "
                    f"request's input alone may cost {input_cost:.0f} (estimate {est}), "
                    f"leaving fewer than {MIN_OUTPUT_TOKENS} tokens for its answer",
                )
            # Lower max_tokens to what is left: the model stops early, within budget.
            granted = room
        amount_usd = 0.0
        if self.budget_usd is not None and self.price is not None:
            granted, amount_usd = self._reserve_usd(est, granted, long_cache)
        amount = input_cost + granted
        self.usage.reserved += amount
        self.usage.reserved_usd += amount_usd
        self._in_flight += 1
        if granted < max_tokens:
            self.usage.clamped += 1
        return Reservation(
            amount, est, granted, requested=max_tokens, amount_usd=amount_usd,
            long_cache=long_cache,
        )  # fmt: skip

    def _reserve_usd(self, est: int, max_tokens: int, long_cache: bool) -> tuple[int, float]:
        """The dollar side of :meth:`reserve`: ``max_tokens`` as the dollars left allow,
        and the dollars held; :class:`Refusal` when fewer than the minimum would be left."""
        assert self.price is not None and self.budget_usd is not None
        left = self.remaining_usd or 0.0
        input_usd = est * self._input_usd(long_cache)
        per_output = self.price.output / PER
        room = math.floor((left - input_usd) / per_output) if per_output > 0 else max_tokens
        granted = min(max_tokens, room)
        if granted < max_tokens and room < MIN_OUTPUT_TOKENS:
            u = self.usage
            if u.reserved == 0:
                u.exhausted = True
            raise Refusal(
                "over_budget",
                f"dollar budget exhausted: {format_usd(u.cost_usd)} of "
                f"{format_usd(self.budget_usd)} used and {format_usd(max(left, 0.0))} left "
                f"({format_usd(u.reserved_usd)} held by requests in flight); this request's "
                f"input alone may cost {format_usd(input_usd)} (estimate {est} tokens), "
                f"leaving fewer than {MIN_OUTPUT_TOKENS} tokens for its answer",
            )
        return granted, input_usd + granted * per_output

    def settle(self, r: Reservation, count: TokenCount | None, *, complete: bool) -> float:
        """Release ``r`` and charge what the request cost; returns the charge.

        ``complete``: the usage in ``count`` is final. Otherwise (a dropped stream,
        an unreadable answer) the reservation stays charged, except that an input
        count already read from the stream replaces the estimate.
        """
        if r.settled:
            return 0.0
        r.settled = True
        self._unhold(r)
        if count is None:
            count = TokenCount()
        extra_usd = 0.0
        if not complete:
            if count.input is None:
                count.input = math.ceil(r.input_estimate * self._input_weight(r.long_cache))
                if self.price is not None:
                    # Dollars of the unknown input at its worst rate, not the token weight's.
                    extra_usd = r.input_estimate * self._input_usd(r.long_cache) - (
                        count.input * self.price.input / PER
                    )
            count.output = max(count.output or 0, r.max_tokens)
        charge = self.weigh(count)
        u = self.usage
        u.input += count.input or 0
        u.output += count.output or 0
        u.cache_creation += count.cache_creation
        u.cache_creation_1h += count.cache_creation_1h
        u.cache_read += count.cache_read
        u.weighted_total = round(u.weighted_total + charge, 3)
        if u.cost_usd is not None:
            u.cost_usd = u.cost_usd + self.cost(count) + max(extra_usd, 0.0)
        if u.weighted_total >= self.budget or (
            self.budget_usd is not None and (u.cost_usd or 0.0) >= self.budget_usd
        ):
            u.exhausted = True
        return charge

    def release(self, r: Reservation) -> None:
        """Give back a reservation for a request the upstream refused (not billed)."""
        if not r.settled:
            r.settled = True
            self._unhold(r)

    def _unhold(self, r: Reservation) -> None:
        u = self.usage
        self._in_flight -= 1
        u.reserved = max(0.0, u.reserved - r.amount)
        u.reserved_usd = max(0.0, u.reserved_usd - r.amount_usd)
        if self._in_flight <= 0:
            # Nothing in flight: drop what float subtraction left behind (1e-18 …).
            self._in_flight, u.reserved, u.reserved_usd = 0, 0.0, 0.0

    def refuse(self, reason: str) -> None:
        """Count a request the gateway itself refused."""
        self.usage.refusals[reason] = self.usage.refusals.get(reason, 0) + 1
