"""The per-task egress proxy: a setup phase's (or an opted-in agent phase's) only way out.

A sandbox has no network device in any phase. When a phase may reach package
registries (Boxfile ``[setup] network = "registries"``) or named hosts
(``[network] allow``), the launcher starts one proxy process per task on a unix
socket in the task's directory; the socket is mounted into the sandbox and relayed
to ``127.0.0.1:<port>`` by the in-sandbox relay (``guest/relay.py --port P --socket
S``), and the phase's command gets :func:`proxy_env`.

The proxy accepts only ``CONNECT host:443`` (or a registry's configured port) and
plain-HTTP ``GET``/``HEAD`` in absolute form, to allowed names; it resolves each
name itself and connects only to addresses it checked (refusing IP literals,
loopback, private, link-local, CGNAT, metadata, multicast, unspecified and
reserved addresses, except that names from the host's own client configuration
may resolve to private and reserved ones, and the ``egress_trusted_ranges``
setting lists ranges any allowed name may use); it caps bytes each way per task,
concurrent connections and each connection's time, idle time and request head;
and it logs every attempt as a JSON line. It runs unprivileged, confined and
memory-bounded, as the gateway does. See ``docs/reference/egress.md``.

Public API::

    policy = EgressPolicy.for_phase(settings, allow=["host", "*.suffix"], registries=True)
    with spawn_proxy(socket_path, policy, log_path, run_as=(uid, gid)) as proxy:
        ...                                  # proxy.pid, proxy.alive(), proxy.stop()
    summary = summarize(log_path)            # EgressSummary: per host counts and bytes
    ca = host_ca_bundle(settings)            # mount read-only into the sandbox
    env = proxy_env(port, "/run/agentbox/egress/ca.pem")

- :class:`EgressPolicy` (frozen; ``for_phase(settings, allow=[...], registries=bool)``)
  raises :class:`~agentbox.errors.PolicyRefused` for an ``allow`` entry outside the
  host's ``egress_allow_cap``;
- :func:`spawn_proxy` ``(socket_path, policy, log_path, run_as=None) -> ProxyHandle``
  raises :class:`~agentbox.errors.EgressError` if it does not start;
- :func:`summarize` ``(log_path) -> EgressSummary``;
- :func:`host_ca_bundle` ``(settings) -> Path``; :func:`proxy_env` ``(port, ca_path)``;
- :func:`brokered_for_phase` (the host user's registry and git credentials as rules, with
  their values for the proxy only), :func:`combine` (those with a Boxfile's, in order);
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentbox.egress._env import host_ca_bundle, proxy_env
from agentbox.egress._hostcfg import host_registries
from agentbox.egress._hostcreds import Brokered, brokered_for_phase, combine, git_fetch_rules
from agentbox.egress._policy import AllowRule, EgressLimits, EgressPolicy
from agentbox.egress._record import EgressSummary, HostSummary, format_record, summarize

if TYPE_CHECKING:
    from agentbox.egress._process import ProxyHandle, spawn_proxy

__all__ = [
    "AllowRule",
    "Brokered",
    "EgressLimits",
    "EgressPolicy",
    "EgressSummary",
    "HostSummary",
    "ProxyHandle",
    "brokered_for_phase",
    "combine",
    "format_record",
    "git_fetch_rules",
    "host_ca_bundle",
    "host_registries",
    "proxy_env",
    "spawn_proxy",
    "summarize",
]


def __getattr__(name: str) -> Any:
    """:func:`spawn_proxy` and :class:`ProxyHandle`, on first use.

    The proxy's side (its asyncio server, h11, the address checks) is imported only
    by a task that starts a proxy: every ``agentbox run`` imports this package for
    :class:`EgressPolicy`, and most run with no egress at all.
    """
    if name in ("ProxyHandle", "spawn_proxy"):
        from agentbox.egress import _process

        return getattr(_process, name)
    raise AttributeError(name)
