"""Prices of a model in US dollars per million tokens, and what a count of tokens costs.

A registry entry may carry a ``[models.X.price]`` table; an entry without one has no
price, and what its tasks cost is unknown (``None``), never $0. The kinds of tokens are
the ones the Messages API reports apart: uncached input, output (thinking included),
5-minute cache writes, 1-hour cache writes and cache reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Prices are per this many tokens.
PER = 1_000_000


@dataclass(frozen=True)
class Price:
    """US dollars per million tokens of each kind."""

    input: float
    output: float
    cache_write: float | None = None
    """5-minute cache writes; default 1.25x input."""
    cache_read: float | None = None
    """Cache reads (hits and refreshes); default 0.1x input."""
    cache_write_1h: float | None = None
    """1-hour cache writes; default 2x input."""

    @property
    def write_5m(self) -> float:
        return self.input * 1.25 if self.cache_write is None else self.cache_write

    @property
    def write_1h(self) -> float:
        return self.input * 2.0 if self.cache_write_1h is None else self.cache_write_1h

    @property
    def read(self) -> float:
        return self.input * 0.1 if self.cache_read is None else self.cache_read

    @property
    def worst_input(self) -> float:
        """The most one input token can cost (per million): it may turn out a cache write."""
        return max(self.input, self.write_5m, self.write_1h, self.read)

    def cost(
        self,
        *,
        input: int = 0,
        output: int = 0,
        cache_creation: int = 0,
        cache_creation_1h: int = 0,
        cache_read: int = 0,
    ) -> float:
        """US dollars for these counts; ``cache_creation`` is all cache writes, 1-hour ones
        included (as the API reports ``cache_creation_input_tokens``)."""
        five = max(cache_creation - cache_creation_1h, 0)
        return (
            input * self.input
            + output * self.output
            + five * self.write_5m
            + cache_creation_1h * self.write_1h
            + cache_read * self.read
        ) / PER

    def to_json(self) -> dict[str, float]:
        """The five prices, defaults filled in."""
        return {
            "input": self.input,
            "output": self.output,
            "cache_write": self.write_5m,
            "cache_write_1h": self.write_1h,
            "cache_read": self.read,
        }

    @classmethod
    def check(cls, raw: Any, key: str, errors: list[tuple[str, str]]) -> Price | None:
        """A price from a registry's ``price`` table, or None with what is wrong in ``errors``."""
        if raw is None or isinstance(raw, Price):
            return raw
        if not isinstance(raw, dict):
            errors.append((key, "must be a table of prices (input, output, …)"))
            return None
        known = ("input", "output", "cache_write", "cache_read", "cache_write_1h")
        n = len(errors)
        for name in raw:
            if name not in known:
                errors.append(
                    (
                        f"{key}.{name}",
                        "is not a price (input, output, cache_write, cache_write_1h, cache_read)",
                    )
                )
        values: dict[str, float] = {}
        for name in known:
            v = raw.get(name)
            if v is None:
                if name in ("input", "output"):
                    errors.append((f"{key}.{name}", "is required"))
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                errors.append(
                    (
                        f"{key}.{name}",
                        f"must be a number >= 0 (USD per million tokens), not {v!r:.40}",
                    )
                )
                continue
            values[name] = float(v)
        if len(errors) > n:
            return None
        return cls(**values)


def format_usd(value: float | None) -> str:
    """``$0.0123`` (4 decimals under a dollar, 2 above), or ``price unknown``."""
    if value is None:
        return "price unknown"
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}"
