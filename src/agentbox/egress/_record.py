"""The egress log: one JSON line per attempt, and its summary for the task's report.

Each line holds ``time`` (UTC, ISO 8601), ``conn`` (a per-proxy connection
number), ``method``, ``host``, ``port``, ``decision`` (``allowed``/``denied``),
``rule`` (the allow rule that matched, or why the attempt was denied:
``not-allowed``, ``port``, ``ip-literal``, ``method``, ``address:<class>`` …),
``reason`` (words for a human), ``address`` (what the proxy connected to, or the
address it refused), ``status`` (the HTTP status the proxy answered), ``bytes_up``,
``bytes_down``, ``duration`` (seconds) and ``end`` (why the connection ended:
``closed``, ``idle``, ``time``, ``byte-cap``, ``error``). A request inside a tunnel
the proxy terminated (request-level rules) is a line of its own, with ``path`` (the
query's values elided), ``injected`` (true/false; never the value), ``redacted`` (how
many echoes of a secret were blanked) and, when no rule matched, ``suggest``: the
``[[network.rule]]`` that would allow it. Everything in it that the
sandbox chose (host, method) is bounded in length and JSON-escaped.

The file is written through a descriptor opened before the proxy drops its
privileges, and capped (``max_log_bytes``): past the cap, attempts are counted and
one final ``{"truncated": N}`` line says how many were not logged.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_MAX_FIELD = 300
#: Room kept past the cap for the closing ``truncated`` line.
_TAIL = 64


def _bounded(value: object) -> object:
    if isinstance(value, str) and len(value) > _MAX_FIELD:
        return value[:_MAX_FIELD] + "…"
    return value


class EgressLog:
    """Appends attempt records to the egress log through one descriptor."""

    def __init__(self, path: Path, *, max_bytes: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self._max = max_bytes
        self._written = os.fstat(self._fd).st_size
        self.dropped = 0

    def write(self, **record: Any) -> None:
        """Append one record (``time`` added); counted instead once the log is full."""
        stamp = datetime.fromtimestamp(time.time(), UTC).isoformat(timespec="milliseconds")
        fields = {"time": stamp, **{k: _bounded(v) for k, v in record.items()}}
        line = (json.dumps(fields, ensure_ascii=True, separators=(",", ":")) + "\n").encode()
        if self._written + len(line) > self._max - _TAIL:
            self.dropped += 1
            return
        self._emit(line)

    def _emit(self, line: bytes) -> None:
        try:
            os.write(self._fd, line)
            self._written += len(line)
        except OSError:
            self.dropped += 1

    def close(self) -> None:
        """Write the ``truncated`` line if anything was dropped, and close; idempotent."""
        if self._fd < 0:
            return
        if self.dropped:
            self._emit(json.dumps({"truncated": self.dropped}).encode() + b"\n")
        os.close(self._fd)
        self._fd = -1


class HostSummary(BaseModel):
    """One host's attempts through the proxy."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    host: str
    allowed: int = 0
    denied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    denied_rules: list[str] = Field(default_factory=list)
    """Distinct reasons this host was denied (``not-allowed``, ``address:loopback`` …)."""
    injected: int = 0
    """Requests a rule added a header to (request-level rules)."""


class Refusal(BaseModel):
    """A request a request-level rule refused, and the rule that would allow it."""

    model_config = ConfigDict(defer_build=True)

    method: str
    host: str
    path: str
    rule: str
    reason: str = ""
    suggest: str | None = None
    """A ``[[network.rule]]`` table to paste into the Boxfile (no rule matched)."""


class EgressSummary(BaseModel):
    """The egress log of one task, per host, for the report and ``agentbox show``."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    hosts: list[HostSummary] = Field(default_factory=list)
    allowed: int = 0
    denied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    unlogged: int = 0
    """Attempts past the log's size cap (counted, not logged)."""
    unreadable: int = 0
    """Lines that were not a well-formed record (a log is read defensively)."""
    injected: int = 0
    """Requests a rule added a header to."""
    refused: list[Refusal] = Field(default_factory=list)
    """Requests refused per request (the first :data:`MAX_REFUSALS`, distinct)."""


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def summarize(log_path: Path, *, max_bytes: int = 64 << 20) -> EgressSummary:
    """Per-host allowed and denied counts and bytes of an egress log (missing file: empty).

    Reads at most ``max_bytes`` of it; malformed lines are counted in ``unreadable``.
    """
    summary = EgressSummary()
    per: dict[str, HostSummary] = {}
    try:
        with log_path.open("rb") as fh:
            data = fh.read(max_bytes)
    except FileNotFoundError:
        return summary
    for raw in data.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            summary.unreadable += 1
            continue
        if not isinstance(rec, dict):
            summary.unreadable += 1
            continue
        if "truncated" in rec:
            summary.unlogged += _int(rec["truncated"])
            continue
        host, decision = rec.get("host"), rec.get("decision")
        if not isinstance(host, str) or decision not in ("allowed", "denied"):
            summary.unreadable += 1
            continue
        hs = per.setdefault(host, HostSummary(host=host))
        up, down = _int(rec.get("bytes_up")), _int(rec.get("bytes_down"))
        hs.bytes_up += up
        hs.bytes_down += down
        summary.bytes_up += up
        summary.bytes_down += down
        if rec.get("injected") is True:
            hs.injected += 1
            summary.injected += 1
        if decision == "allowed":
            hs.allowed += 1
            summary.allowed += 1
        else:
            hs.denied += 1
            summary.denied += 1
            rule = rec.get("rule")
            if isinstance(rule, str) and rule not in hs.denied_rules:
                hs.denied_rules.append(rule)
            _refusal(summary, rec, host)
    summary.hosts = sorted(per.values(), key=lambda h: (-h.allowed - h.denied, h.host))
    return summary


#: Refused requests a summary keeps (distinct method, host, path and rule).
MAX_REFUSALS = 20


def _refusal(summary: EgressSummary, rec: dict[str, Any], host: str) -> None:
    path, method, rule = rec.get("path"), rec.get("method"), rec.get("rule")
    if not isinstance(path, str) or not isinstance(method, str) or not isinstance(rule, str):
        return  # a tunnel-level refusal: the host summary says it
    if len(summary.refused) >= MAX_REFUSALS:
        return
    if any(
        (r.method, r.host, r.path, r.rule) == (method, host, path, rule) for r in summary.refused
    ):
        return
    reason, suggest = rec.get("reason"), rec.get("suggest")
    summary.refused.append(
        Refusal(
            method=method,
            host=host,
            path=path,
            rule=rule,
            reason=reason if isinstance(reason, str) else "",
            suggest=suggest if isinstance(suggest, str) else None,
        )
    )


def format_record(rec: dict[str, Any]) -> str:
    """One egress log record as a line for ``agentbox logs`` (sanitize before printing)."""
    if "truncated" in rec:
        return f"({rec.get('truncated')} attempts past the log's cap not logged)"
    when = str(rec.get("time", ""))[11:19]
    what = f"{rec.get('method', '-')} {rec.get('host', '-')}"
    if isinstance(rec.get("path"), str):
        what += str(rec["path"])
    elif rec.get("port") not in (None, 443, 80):
        what += f":{rec.get('port')}"
    status = rec.get("status")
    out = f"{when} {what} → {status if status is not None else '-'} {rec.get('decision', '?')}"
    out += f" [{rec.get('rule', '-')}]"
    if rec.get("injected") is True:
        out += " injected"
    if rec.get("redacted"):
        out += f" ({rec.get('redacted')} echoes redacted)"
    if rec.get("decision") == "denied" and rec.get("reason"):
        out += f": {rec.get('reason')}"
    return out
