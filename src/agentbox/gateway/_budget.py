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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentbox.errors import Refusal
from agentbox.gateway._meter import TokenCount
from agentbox.gateway._usage import Usage

__all__ = ["MIN_OUTPUT_TOKENS", "Ledger", "Refusal", "Reservation"]

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
    bytes_per_token: float = 1.0
    """Input estimate = body bytes / this. 1.0 never undercounts text: a BPE token
    covers at least one byte, and the JSON body holds all of the prompt's text."""
    overhead_tokens: int = 512
    """Added to every input estimate: tokens the API adds (tool-use system prompt …)."""
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(model=self.model, budget=self.budget)

    # -- pricing -----------------------------------------------------------------------
    def weigh(self, c: TokenCount) -> float:
        """What ``c`` costs against the budget."""
        return (
            (c.input or 0)
            + (c.output or 0)
            + c.cache_creation * self.cache_creation_weight
            + c.cache_read * self.cache_read_weight
        )

    def estimate_input(self, body_len: int) -> int:
        """A conservative input token estimate for a request body of ``body_len`` bytes."""
        return math.ceil(body_len / self.bytes_per_token) + self.overhead_tokens

    @property
    def _input_weight(self) -> float:
        # Worst case: every input token turns out to be a cache write.
        return max(1.0, self.cache_creation_weight, self.cache_read_weight)

    @property
    def remaining(self) -> float:
        """Budget neither charged nor reserved."""
        return self.budget - self.usage.weighted_total - self.usage.reserved

    # -- the two steps -----------------------------------------------------------------
    def reserve(self, body_len: int, max_tokens: int, extra_input: int = 0) -> Reservation:
        """Hold the worst case of a request, or raise :class:`Refusal` (nothing held).

        ``extra_input``: input tokens the body's bytes do not bound (images, PDFs …,
        counted by the request policy), added to the estimate.
        """
        if self.usage.weighted_total >= self.budget:
            self.usage.exhausted = True
            raise Refusal(
                "budget_exhausted",
                f"token budget exhausted: {self.usage.weighted_total:.0f} of "
                f"{self.budget} tokens used",
            )
        est = self.estimate_input(body_len) + extra_input
        input_cost = est * self._input_weight
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
        amount = input_cost + granted
        self.usage.reserved += amount
        if granted < max_tokens:
            self.usage.clamped += 1
        return Reservation(amount, est, granted, requested=max_tokens)

    def settle(self, r: Reservation, count: TokenCount | None, *, complete: bool) -> float:
        """Release ``r`` and charge what the request cost; returns the charge.

        ``complete``: the usage in ``count`` is final. Otherwise (a dropped stream,
        an unreadable answer) the reservation stays charged, except that an input
        count already read from the stream replaces the estimate.
        """
        if r.settled:
            return 0.0
        r.settled = True
        self.usage.reserved = max(0.0, self.usage.reserved - r.amount)
        if count is None:
            count = TokenCount()
        if not complete:
            if count.input is None:
                count.input = math.ceil(r.input_estimate * self._input_weight)
            count.output = max(count.output or 0, r.max_tokens)
        charge = self.weigh(count)
        u = self.usage
        u.input += count.input or 0
        u.output += count.output or 0
        u.cache_creation += count.cache_creation
        u.cache_read += count.cache_read
        u.weighted_total = round(u.weighted_total + charge, 3)
        if u.weighted_total >= self.budget:
            u.exhausted = True
        return charge

    def release(self, r: Reservation) -> None:
        """Give back a reservation for a request the upstream refused (not billed)."""
        if not r.settled:
            r.settled = True
            self.usage.reserved = max(0.0, self.usage.reserved - r.amount)

    def refuse(self, reason: str) -> None:
        """Count a request the gateway itself refused."""
        self.usage.refusals[reason] = self.usage.refusals.get(reason, 0) + 1
