"""Host names and addresses: what the proxy accepts as a name, and which addresses it refuses.

The proxy never lets the sandbox name an address: a request names a host, the
proxy resolves it itself and checks every address it got before connecting to
one of exactly those (no second resolution, so DNS rebinding gains nothing).
"""

from __future__ import annotations

import ipaddress

from agentbox.core.hostname import normalize_host

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud instance-metadata endpoints (AWS/GCP/Azure/OpenStack, AWS IPv6, ECS, Alibaba).
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200")
)
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_PRIVATE: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
#: Classes refused even for the host's own registries (a host setting may still list the
#: range, except for metadata, which nothing allows).
ALWAYS_DENIED = frozenset({"metadata", "loopback", "multicast", "unspecified"})


def canonical(addr: Address) -> Address:
    """An IPv4 address carried in IPv6 (mapped ``::ffff:a.b.c.d``, NAT64, 6to4) as IPv4."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr in _NAT64:
            return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if addr.sixtofour is not None:
            return addr.sixtofour
    return addr


def address_class(addr: Address) -> str | None:
    """The class that makes ``addr`` not a public address, or None for a public one.

    One of ``metadata``, ``unspecified``, ``loopback``, ``multicast``, ``link-local``,
    ``cgnat`` (100.64/10), ``private`` (RFC 1918, IPv6 ULA) or ``reserved`` (anything
    else that is not globally routable: documentation, benchmarking, 240/4 …).
    """
    addr = canonical(addr)
    if addr in METADATA:
        return "metadata"
    if addr.is_unspecified:
        return "unspecified"
    if addr.is_loopback:
        return "loopback"
    if addr.is_multicast:
        return "multicast"
    if addr.is_link_local:
        return "link-local"
    if isinstance(addr, ipaddress.IPv4Address) and addr in _CGNAT:
        return "cgnat"
    if any(addr.version == n.version and addr in n for n in _PRIVATE):
        return "private"
    if not addr.is_global:
        return "reserved"
    return None


def check_address(
    addr: Address, *, trusted_name: bool, trusted_ranges: tuple[Network, ...]
) -> str | None:
    """Why the proxy must not connect to ``addr``, or None if it may.

    Metadata addresses are always refused. An address in one of ``trusted_ranges``
    (the host setting) is allowed. A name from the host's own client configuration
    (``trusted_name``) may resolve to private and reserved addresses, never to
    loopback, multicast or the unspecified address; any other name only to public ones.
    """
    cls = address_class(addr)
    if cls == "metadata":
        return cls
    plain = canonical(addr)
    if any(plain.version == n.version and plain in n for n in trusted_ranges):
        return None
    if cls is None or (trusted_name and cls not in ALWAYS_DENIED):
        return None
    return cls


def normalize_pattern(raw: str) -> str:
    """``host`` or ``*.suffix`` (``*`` alone only where a cap allows anything)."""
    if raw == "*":
        return raw
    if raw.startswith("*."):
        return "*." + normalize_host(raw[2:])
    return normalize_host(raw)


def host_matches(pattern: str, host: str) -> bool:
    """Whether normalized ``host`` is named by ``pattern`` (``*.suffix`` matches strict
    subdomains of ``suffix``, not ``suffix`` itself; ``*`` matches anything)."""
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def pattern_covers(cap: str, pattern: str) -> bool:
    """Whether every host ``pattern`` names is also named by ``cap``."""
    if cap == "*":
        return True
    if pattern == "*":
        return False
    if pattern.startswith("*."):
        return cap.startswith("*.") and (pattern == cap or pattern[2:].endswith(cap[1:]))
    return host_matches(cap, pattern)
