"""A proxied request's parts: what a refusal says, what the log records, host checks.

Used by :mod:`._proxy` (the connection handling); nothing here does I/O but
:func:`system_resolver`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agentbox.core.hostname import normalize_host

#: ``(host, port) -> addresses``; the default asks the host's resolver (getaddrinfo).
Resolver = Callable[[str, int], Awaitable[list[str]]]

REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    408: "Request Timeout",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
HOP = frozenset(
    b"connection keep-alive proxy-connection proxy-authorization proxy-authenticate "
    b"te trailer transfer-encoding upgrade host content-length".split()
)


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's resolver (``getaddrinfo``), TCP addresses in its order, without repeats."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _Closed(Exception):
    """The client closed before sending a whole request head: nothing to answer or log."""


class _Refuse(Exception):
    """An attempt the proxy answers with an error status (and logs as denied or failed)."""

    def __init__(self, status: int, rule: str, reason: str, *, address: str | None = None):
        super().__init__(reason)
        self.status, self.rule, self.reason, self.address = status, rule, reason, address


@dataclass
class Attempt:
    """What the log records about one connection."""

    conn: int
    start: float
    method: str = "-"
    host: str = "-"
    port: int | None = None
    decision: str = "denied"
    rule: str = "-"
    reason: str = ""
    address: str | None = None
    status: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    end: str = "closed"
    last: float = field(default=0.0)
    requests: int = 0
    """Requests logged on their own (a tunnel whose TLS the proxy terminated)."""


def safe(text: str, limit: int = 200) -> str:
    """Printable ASCII only (what a refusal echoes of the sandbox's request)."""
    out = "".join(c if " " <= c <= "~" else "?" for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


def split_authority(authority: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port); _Refuse 400 when malformed."""
    host, sep, port_s = authority.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 < int(port_s) < 65536 or len(port_s) > 5:
        raise _Refuse(400, "malformed", f"CONNECT needs host:port, got {safe(authority)!r}")
    return host, int(port_s)


def checked_host(raw: str) -> str:
    try:
        ipaddress.ip_address(raw.strip("[]"))
    except ValueError:
        pass
    else:
        raise _Refuse(403, "ip-literal", f"{safe(raw)} is an IP address: name a host")
    try:
        return normalize_host(raw)
    except ValueError as exc:
        rule = "ip-literal" if "address" in str(exc) else "malformed"
        raise _Refuse(403 if rule == "ip-literal" else 400, rule, f"{safe(raw)!r}: {exc}") from None
