"""Is a local model upstream up? Checked when a task is submitted, so a stopped model
server is said at once, not after the task's deadline.

Only a ``compatible`` entry whose upstream is on this host's loopback is checked (a
TCP connect, no request): a remote upstream's reachability says little before the
request (a proxy, a VPN), and is the gateway's to report as it fails.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from agentbox.errors import UpstreamConnectError
from agentbox.gateway.registry import ModelEntry

#: How long a connect to a loopback upstream may take (nothing listening is refused at once).
CONNECT_TIMEOUT = 2.0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_local_upstream(entry: ModelEntry) -> None:
    """Raise :class:`UpstreamConnectError` when nothing listens at ``entry``'s loopback
    upstream ("nothing listens on 127.0.0.1:18081"); any other entry passes."""
    if entry.kind != "compatible":
        return
    try:
        parts = urlsplit(entry.upstream)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return  # the registry checked the URL; the gateway reports what is left
    if not _loopback(host):
        return
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UpstreamConnectError(
            f"model {entry.name!r}: nothing listens on {where}, its upstream in the model "
            f"registry ({why.lower()}); start its server there, or choose another model "
            "(agentbox models)"
        ) from exc
