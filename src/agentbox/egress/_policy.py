"""What one task's proxy allows: the allow-list, the trusted address ranges and the caps.

An :class:`EgressPolicy` is a frozen value, built once on the host
(:meth:`EgressPolicy.for_phase`) and handed to the proxy process as JSON on its
standard input. The proxy itself reads no configuration.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentbox.config import Settings
from agentbox.egress._addr import (
    Network,
    host_matches,
    normalize_pattern,
    pattern_covers,
)
from agentbox.egress._hostcfg import host_registries
from agentbox.egress.rules import NetworkRule, rule_hosts
from agentbox.errors import PolicyRefused


class AllowRule(BaseModel):
    """One allowed name (``host`` or ``*.suffix``), where it came from, and its ports."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    pattern: str
    source: Literal["pip", "npm", "uv", "boxfile", "test"]
    trusted: bool = False
    """From the host's own client configuration: may resolve to private/reserved addresses."""
    tls_ports: frozenset[int] = frozenset({443})
    """Ports ``CONNECT`` may reach."""
    http_ports: frozenset[int] = frozenset({80})
    """Ports a plain-HTTP ``GET``/``HEAD`` may reach."""

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        if v == "*":
            raise ValueError("'*' is a cap, not an allow rule")
        return normalize_pattern(v)

    @property
    def name(self) -> str:
        """How the log names this rule: ``pip:host``, ``boxfile:*.suffix``."""
        return f"{self.source}:{self.pattern}"


class EgressLimits(BaseModel):
    """Caps of one task's proxy (each byte cap is a total over the task's connections)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes_up: int = Field(default=256 << 20, ge=1)
    """Bytes from the sandbox to the internet, all connections together."""
    max_bytes_down: int = Field(default=8 << 30, ge=1)
    """Bytes from the internet to the sandbox, all connections together."""
    max_connections: int = Field(default=32, ge=1, le=4096)
    """Connections open at once; more are answered 503."""
    max_connection_time: float = Field(default=900.0, gt=0)
    """Seconds one connection may last, busy or not."""
    idle_timeout: float = Field(default=60.0, gt=0)
    """Seconds a connection may pass with no byte either way."""
    header_timeout: float = Field(default=10.0, gt=0)
    """Seconds to receive a request's head."""
    max_header_bytes: int = Field(default=16384, ge=1024, le=1 << 20)
    """Size of a request's head (request line and headers)."""
    connect_timeout: float = Field(default=15.0, gt=0)
    """Seconds to resolve a name and connect to it."""
    max_log_bytes: int = Field(default=16 << 20, ge=4096)
    """Size of the egress log; past it attempts are counted, not logged."""


class Verdict(BaseModel):
    """The proxy's answer to a name and port before resolution."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True, frozen=True)

    allowed: bool
    rule: str
    """The allow rule that matched, or why none did (``not-allowed``, ``port``…)."""
    trusted: bool = False


class EgressPolicy(BaseModel):
    """Everything one proxy enforces. Frozen; JSON round-trips (``model_dump_json``)."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    rules: tuple[AllowRule, ...] = ()
    trusted_ranges: tuple[str, ...] = ()
    """CIDR ranges any allowed name may resolve to (the host setting)."""
    limits: EgressLimits = EgressLimits()
    address_checks: bool = True
    """False only for the escape suite's positive control (a proxy that checks nothing)."""
    request_rules: tuple[dict[str, Any], ...] = ()
    """Request-level rules (:class:`~agentbox.egress.rules.NetworkRule` as dicts): a host
    they name is reached only through TLS termination, request by request."""
    phase: Literal["setup", "agent"] = "agent"
    """The phase the proxy serves (rules name their phases)."""
    hosts_map: dict[str, str] = Field(default_factory=dict)
    """The host's ``egress_hosts`` setting: names resolved to these addresses, trusted."""
    upstream_ca: tuple[str, ...] = ()
    """CA files (the ``egress_upstream_ca`` setting) trusted for upstreams besides the system's."""

    @cached_property
    def network_rules(self) -> tuple[NetworkRule, ...]:
        """``request_rules`` parsed, this phase's only."""
        rules = (NetworkRule.from_dict(d) for d in self.request_rules)
        return tuple(r for r in rules if self.phase in r.phases)

    def with_rules(self, rules: Iterable[NetworkRule]) -> EgressPolicy:
        """This policy with ``rules`` added (after its own)."""
        extra = tuple(r.to_dict() for r in rules)
        # A new model, not model_copy: that would carry the cached ``network_rules``.
        data = self.model_dump()
        data["request_rules"] = self.request_rules + extra
        return type(self).model_validate(data)

    @field_validator("trusted_ranges")
    @classmethod
    def _ranges(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_network(r, strict=False)) for r in v)

    @property
    def networks(self) -> tuple[Network, ...]:
        """``trusted_ranges`` parsed."""
        return tuple(ipaddress.ip_network(r) for r in self.trusted_ranges)

    def decide(self, host: str, port: int, *, tls: bool) -> Verdict:
        """Whether ``host:port`` may be reached (by ``CONNECT`` when ``tls``, else a GET).

        ``host`` must already be normalized (:func:`._addr.normalize_host`). The first rule
        that names the host and the port wins; a trusted rule is preferred.
        """
        if any(host_matches(r.host, host) for r in self.network_rules):
            # Decided per request (TLS terminated); only CONNECT to 443 or a port an
            # allow rule gives the host; never plain HTTP (an injected secret in clear).
            ports = {443}.union(*(r.tls_ports for r in self.rules if host_matches(r.pattern, host)))
            if not tls or port not in ports:
                return Verdict(allowed=False, rule="port")
            trusted = host in self.hosts_map or any(
                r.trusted for r in self.rules if host_matches(r.pattern, host)
            )
            return Verdict(allowed=True, rule="rules", trusted=trusted)
        named = [r for r in self.rules if host_matches(r.pattern, host)]
        if not named:
            return Verdict(allowed=False, rule="not-allowed")
        fits = [r for r in named if port in (r.tls_ports if tls else r.http_ports)]
        if not fits:
            return Verdict(allowed=False, rule="port")
        best = next((r for r in fits if r.trusted), fits[0])
        trusted = best.trusted or host in self.hosts_map
        return Verdict(allowed=True, rule=best.name, trusted=trusted)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The allowed patterns (rule hosts too), in order, without repeats."""
        pats = [r.pattern for r in self.rules] + list(rule_hosts(self.network_rules))
        return tuple(dict.fromkeys(pats))

    @classmethod
    def for_phase(
        cls,
        settings: Settings,
        *,
        allow: Iterable[str] = (),
        registries: bool = False,
        limits: EgressLimits | None = None,
        env: Mapping[str, str] | None = None,
        rules: Iterable[NetworkRule] = (),
        phase: Literal["setup", "agent"] = "agent",
    ) -> EgressPolicy:
        """The policy of one phase: the host's registries (``registries``) plus ``allow``
        plus request-level ``rules`` (those of ``phase``).

        ``allow`` are a Boxfile's ``[network] allow`` entries; each, and each host a
        Boxfile's rule names, must be covered by the host's ``egress_allow_cap`` setting,
        else :class:`PolicyRefused` naming it (rules from the host's own configuration
        need no cap). ``env`` is the environment the host's clients are asked in (tests).
        """
        allows: list[AllowRule] = []
        if registries:
            for source, scheme, host, port in host_registries(env):
                key = "tls_ports" if scheme == "https" else "http_ports"
                ports = {port, 443 if scheme == "https" else 80}
                allows.append(
                    AllowRule.model_validate(
                        {"pattern": host, "source": source, "trusted": True, key: ports}
                    )
                )
        caps = [normalize_pattern(c) for c in settings.egress_allow_cap]
        for entry in allow:
            try:
                pattern = normalize_pattern(entry)
            except ValueError as exc:
                raise PolicyRefused(f"[network] allow {entry!r:.80}: {exc}") from None
            if pattern == "*":
                raise PolicyRefused("[network] allow '*': name hosts, not everything")
            if not any(pattern_covers(cap, pattern) for cap in caps):
                raise PolicyRefused(
                    f"[network] allow {pattern!r} is outside this host's egress cap "
                    f"(AGENTBOX_EGRESS_ALLOW_CAP={','.join(caps) or '(empty)'})"
                )
            allows.append(AllowRule(pattern=pattern, source="boxfile"))
        mine = tuple(r for r in rules if phase in r.phases)
        for rule in mine:
            if rule.origin == "boxfile" and not any(pattern_covers(c, rule.host) for c in caps):
                where = f"[[network.rule]] #{rule.line}" if rule.line else "[[network.rule]]"
                raise PolicyRefused(
                    f"{where} host {rule.host!r} is outside this host's egress cap "
                    f"(AGENTBOX_EGRESS_ALLOW_CAP={','.join(caps) or '(empty)'})"
                )
        return cls(
            rules=tuple(allows),
            trusted_ranges=settings.egress_trusted_ranges,
            limits=limits or EgressLimits(),
            request_rules=tuple(r.to_dict() for r in mine),
            phase=phase,
            hosts_map=dict(settings.egress_hosts),
            upstream_ca=tuple(str(p) for p in settings.egress_upstream_ca),
        )
