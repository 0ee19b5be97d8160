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

A best-of-N group with a shared budget (``--budget-split shared``) gives every
attempt's gateway the group's budget and a :class:`GroupShare`: a small file that
every gateway of the group holds open (the launcher links it into each gateway's
state directory as :data:`GROUP_BUDGET_FILE`), one slot per gateway with what that
gateway has charged and holds. A reservation is checked and taken under the
file's ``flock``, against the group's budget minus every slot, so the invariant
above holds for the group's total. Each slot names its holder (pid and start time,
under ``holders``): a gateway that ended with requests in flight (killed mid-request)
has what it held turned into what it charged by the next gateway that takes the lock
(:meth:`GroupShare.reclaim`), as its own ledger would have settled a request whose end
it did not see: the hold no longer counts as in flight (the group can be found spent),
and the worst case the upstream may have billed stays counted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.errors import Refusal
from agentbox.gateway._meter import TokenCount
from agentbox.gateway._price import PER, Price, format_usd
from agentbox.gateway._usage import Usage

#: The fewest output tokens a clamped request is given; below that it is refused.
#: More than 1,024 so that extended thinking's minimum budget still fits under it.
MIN_OUTPUT_TOKENS = 2048
#: The name of a shared group budget's file in a gateway's state directory.
GROUP_BUDGET_FILE = "group-budget.json"
#: The most a group budget file may hold (8 attempts' slots are ~1 KiB).
_GROUP_FILE_MAX = 64 * 1024


class GroupShare:
    """One gateway's view of its group's shared budget file (see the module's docs).

    The file is ``{"budget": B, "budget_usd": U, "slots": {KEY: [charged, reserved,
    charged_usd, reserved_usd]}, "holders": {KEY: [pid, start]}}``; this gateway writes
    only its own slot (a random key) and holder, and reads the others' under the same
    lock. A gateway that ended leaves its slot: what it charged stays spent; what it
    held becomes spent once a live gateway of the group sees its holder gone
    (:meth:`reclaim`). A slot without a holder (an older gateway's) is never reclaimed.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.key = secrets.token_hex(8)
        self.holder = [os.getpid(), _start_time(os.getpid())]
        self.others = (0.0, 0.0, 0.0, 0.0)
        """The other slots' sums (charged, reserved, charged_usd, reserved_usd), as last read."""
        with self.locked():
            pass

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the file's lock; dead holders' holds reclaimed and :attr:`others` read
        fresh inside."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            self.reclaim()
            self.others = self._read_others()
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def reclaim(self) -> list[str]:
        """Turn what each other slot whose holder has ended holds into what it charged
        (call with the lock held); the slots reclaimed. A holder that cannot be seen
        (``/proc`` hidden) is taken as alive: nothing is reclaimed on a doubt."""
        doc = self._doc()
        slots, holders = doc.get("slots"), doc.get("holders")
        if not (isinstance(slots, dict) and isinstance(holders, dict)):
            return []
        done = []
        for key, who in list(holders.items()):
            vals = slots.get(key)
            if key == self.key or not (isinstance(vals, list) and len(vals) == 4):
                continue
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
                continue
            if not (vals[1] > 0 or vals[3] > 0) or not _holder_gone(who):
                continue
            slots[key] = [vals[0] + vals[1], 0.0, vals[2] + vals[3], 0.0]
            del holders[key]
            done.append(key)
        if done:
            self._put(doc)
        return done

    def _doc(self) -> dict[str, object]:
        raw = os.pread(self.fd, _GROUP_FILE_MAX + 1, 0)
        try:
            doc = json.loads(raw) if raw.strip() else {}
        except ValueError:
            doc = None
        if len(raw) > _GROUP_FILE_MAX or not isinstance(doc, dict):
            # Never guess a total: a file that cannot be read spends the whole budget.
            return {"slots": {"unreadable": [math.inf, 0.0, math.inf, 0.0]}}
        return doc

    def _read_others(self) -> tuple[float, float, float, float]:
        slots = self._doc().get("slots")
        sums = [0.0, 0.0, 0.0, 0.0]
        if isinstance(slots, dict):
            for key, vals in slots.items():
                if key == self.key or not isinstance(vals, list) or len(vals) != 4:
                    continue
                for i, v in enumerate(vals):
                    ok = isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
                    sums[i] += float(v) if ok else math.inf
        return sums[0], sums[1], sums[2], sums[3]

    def write(self, u: Usage) -> None:
        """Put this gateway's totals in its slot (call with :meth:`locked` held)."""
        doc = self._doc()
        slots = doc.get("slots")
        if not isinstance(slots, dict):
            slots = doc["slots"] = {}
        slots[self.key] = [u.weighted_total, u.reserved, u.cost_usd or 0.0, u.reserved_usd]
        holders = doc.get("holders")
        if not isinstance(holders, dict):
            holders = doc["holders"] = {}
        holders[self.key] = self.holder
        self._put(doc)

    def _put(self, doc: dict[str, object]) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))


def _start_time(pid: int) -> int | None:
    """The process's start time (``/proc/PID/stat`` field 22, clock ticks since boot):
    with its pid, names one process for the machine's uptime. None if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_gone(who: object) -> bool:
    """Whether the holder ``[pid, start]`` has ended (exited, a zombie, or its pid now
    another process's). False when it cannot be told (malformed, or not visible)."""
    if not (isinstance(who, list) and len(who) == 2):
        return False
    pid, start = who
    if type(pid) is not int or pid <= 0 or type(start) is not int:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:
        readable, _, _ = select.select([pidfd], [], [], 0)
        if readable:  # it exited (a zombie not reaped yet too)
            return True
        now = _start_time(pid)
        return now is not None and now != start
    finally:
        os.close(pidfd)


def open_group_share(dir_fd: int) -> GroupShare | None:
    """The group budget file in the gateway's state directory ``dir_fd`` (opened now,
    before the gateway drops its privileges), or None when the task has none."""
    try:
        fd = os.open(GROUP_BUDGET_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return GroupShare(fd)


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
    shared: GroupShare | None = None
    """A best-of-N group's shared budget: the other attempts' totals count too."""
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
        o = self.shared.others if self.shared is not None else (0.0, 0.0, 0.0, 0.0)
        spent = (self.usage.cost_usd or 0.0) + o[2]
        return self.budget_usd - spent - self.usage.reserved_usd - o[3]

    def exhausted_refusal(self) -> Refusal | None:
        """The refusal every request gets once a budget is spent, or None."""
        u = self.usage
        o = self.shared.others if self.shared is not None else (0.0, 0.0, 0.0, 0.0)
        whose = "the group's " if self.shared is not None else ""
        if u.weighted_total + o[0] >= self.budget:
            u.exhausted = True
            return Refusal(
                "budget_exhausted",
                f"{whose}token budget exhausted: {u.weighted_total + o[0]:.0f} of "
                f"{self.budget} tokens used",
            )
        if self.budget_usd is not None and (u.cost_usd or 0.0) + o[2] >= self.budget_usd:
            u.exhausted = True
            return Refusal(
                "budget_exhausted",
                f"{whose}dollar budget exhausted: {format_usd((u.cost_usd or 0.0) + o[2])} of "
                f"{format_usd(self.budget_usd)} used",
            )
        return None

    def _nothing_held(self) -> bool:
        """No request in flight, here or (shared) in another attempt, could free budget."""
        others = self.shared.others[1] if self.shared is not None else 0.0
        return self.usage.reserved == 0 and others == 0

    @property
    def remaining(self) -> float:
        """Budget neither charged nor reserved (shared: by any attempt of the group)."""
        o = self.shared.others if self.shared is not None else (0.0, 0.0, 0.0, 0.0)
        return self.budget - self.usage.weighted_total - self.usage.reserved - o[0] - o[1]

    @contextlib.contextmanager
    def _group(self) -> Iterator[None]:
        """Shared: the group file's lock, the others read fresh, this slot written at the end."""
        if self.shared is None:
            yield
            return
        with self.shared.locked():
            try:
                yield
            finally:
                self.shared.write(self.usage)

    # -- the two steps -----------------------------------------------------------------
    def reserve(
        self, body_len: int, max_tokens: int, extra_input: int = 0, *, long_cache: bool = False
    ) -> Reservation:
        """Hold the worst case of a request, or raise :class:`Refusal` (nothing held).

        ``extra_input``: input tokens the body's bytes do not bound (images, PDFs …,
        counted by the request policy), added to the estimate. ``long_cache``: the
        request may write 1-hour cache entries.
        """
        with self._group():
            return self._reserve(body_len, max_tokens, extra_input, long_cache)

    def _reserve(
        self, body_len: int, max_tokens: int, extra_input: int, long_cache: bool
    ) -> Reservation:
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
                if self._nothing_held():
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
            if self._nothing_held():
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
        with self._group():
            return self._settle(r, count, complete)

    def _settle(self, r: Reservation, count: TokenCount | None, complete: bool) -> float:
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
        o = self.shared.others if self.shared is not None else (0.0, 0.0, 0.0, 0.0)
        if u.weighted_total + o[0] >= self.budget or (
            self.budget_usd is not None and (u.cost_usd or 0.0) + o[2] >= self.budget_usd
        ):
            u.exhausted = True
        return charge

    def release(self, r: Reservation) -> None:
        """Give back a reservation for a request the upstream refused (not billed)."""
        if not r.settled:
            r.settled = True
            with self._group():
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
