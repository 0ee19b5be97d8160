"""One reading of a loopback listen address (``127.0.0.1:PORT``, ``[::1]:PORT``) for the
servers a user starts on this host: the MCP server's HTTP, the web view, the metrics.

Only loopback IP literals: a name is refused even if it is ``localhost`` (what a name
resolves to is not ours to trust at start-up), and so is every other address (it would
be reachable from other machines).
"""

from __future__ import annotations

import ipaddress

from agentbox.errors import PolicyRefused


def check_loopback(host: str, *, who: str) -> None:
    """Refuse ``host`` unless it is a loopback IP literal; ``who`` names the server."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise PolicyRefused(
            f"{who} binds to a loopback address only (127.0.0.1 or ::1), not {host!r:.80}"
        ) from None
    if not addr.is_loopback:
        raise PolicyRefused(
            f"{who} binds to a loopback address only (127.0.0.1 or ::1), not {host}: "
            "it would be reachable from other machines"
        )


def parse_loopback(value: str, *, flag: str, who: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port), loopback only; port 0 lets
    the kernel pick one. ``flag`` names the option in the error."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not port_s.isdigit():
        raise PolicyRefused(f"{flag} wants HOST:PORT, got {value!r:.80}")
    host = host.removeprefix("[").removesuffix("]")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise PolicyRefused(f"port out of range: {port}")
    check_loopback(host, who=who)
    return host, port
