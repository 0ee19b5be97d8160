"""Host names as agentbox accepts them: one normalizer for the settings (``egress_hosts``),
the Boxfile's rules and the egress proxy."""

from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def normalize_host(raw: str) -> str:
    """A host name, lower-cased and without a trailing dot; ValueError if it is not one.

    Refused: IP literals (also the numeric forms ``inet_aton`` takes, such as
    ``2130706433`` or ``0x7f.1``: a top-level label must start with a letter), empty
    or over-long names and labels, and any character outside letters, digits and ``-``.
    """
    if len(raw) > 253 or not raw.isascii():
        raise ValueError("not an ASCII host name of at most 253 characters")
    name = raw.lower().removesuffix(".")
    if _is_ip_literal(name):
        raise ValueError("an IP literal, not a host name")
    labels = name.split(".")
    if not name or not all(_LABEL.match(lab) for lab in labels):
        raise ValueError("not a host name (letters, digits and '-' in dot-separated labels)")
    if not labels[-1][0].isalpha():
        raise ValueError("a numeric top-level label (an address in disguise)")
    return name
