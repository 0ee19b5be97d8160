"""Egress for one phase: the per-task proxy, its socket and CA bundle in the sandbox.

:func:`start_egress` starts a proxy (:mod:`agentbox.egress`) on ``<dir>/egress.sock``
for a phase; the sandbox gets that dir at ``/run/agentbox/gw`` (a container mounts
it; a microVM's guest agent serves the socket there over its channel), the host's
CA bundle read-only at ``/run/agentbox/ca/ca.pem``, and the proxy variables;
:func:`egress_argv` puts the in-sandbox relay (``127.0.0.1:3128`` to that socket)
in front of the phase's command.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX, BindMount
from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, proxy_env
from agentbox.env._report import record_proxy

if TYPE_CHECKING:
    from agentbox.egress import ProxyHandle

__all__ = [
    "CA_DIR_IN_SANDBOX",
    "CA_IN_SANDBOX",
    "EGRESS_PORT",
    "EGRESS_SOCKET_NAME",
    "Egress",
    "egress_argv",
    "start_egress",
]

#: Loopback port inside a sandbox that reaches the task's egress proxy.
EGRESS_PORT = 3128
#: The proxy's socket, in the directory mounted at ``/run/agentbox/gw``.
EGRESS_SOCKET_NAME = "egress.sock"
#: Where the host's CA bundle is mounted (read-only) in a phase with egress: a file in a
#: mounted directory (a microVM mounts directories only, each as a disk).
CA_DIR_IN_SANDBOX = "/run/agentbox/ca"
CA_IN_SANDBOX = f"{CA_DIR_IN_SANDBOX}/ca.pem"
#: The in-image relay shim (the same program that carries the gateway).
_RELAY = "/opt/agentbox/relay.py"


def egress_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` behind the relay to the egress proxy (``127.0.0.1:EGRESS_PORT`` inside)."""
    return [
        "python3", "-I", "-S", _RELAY,
        "--port", str(EGRESS_PORT),
        "--socket", f"{GATEWAY_DIR_IN_SANDBOX}/{EGRESS_SOCKET_NAME}",
        "--", *argv,
    ]  # fmt: skip


@dataclass
class Egress:
    """A running proxy for one phase and what the sandbox needs to use it."""

    proxy: ProxyHandle
    env: dict[str, str]
    mount: BindMount


def start_egress(
    settings: Settings,
    policy: EgressPolicy,
    socket_dir: Path,
    log_path: Path,
    run_as: tuple[int, int] | None,
) -> Egress:
    """Start a proxy on ``socket_dir/egress.sock`` (given to the sandbox uid).

    The host's CA bundle is copied next to ``socket_dir`` (``egress-ca/ca.pem``, 0444,
    the sandbox uid's: runsc's gofer can read it, and a host bundle replaced while the
    task runs changes nothing) and that directory is mounted read-only.
    """
    from agentbox.egress import spawn_proxy  # the proxy's side: only a task that starts one

    sock = socket_dir / EGRESS_SOCKET_NAME
    ca_dir = socket_dir.parent / "egress-ca"
    ca_copy = ca_dir / "ca.pem"
    host_uid = settings.sandbox_host_uid
    if not ca_copy.exists():
        ca_dir.mkdir(mode=0o755, exist_ok=True)
        os.chown(ca_dir, host_uid, host_uid, follow_symlinks=False)
        data = host_ca_bundle(settings).read_bytes()
        fd = os.open(ca_copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chown(ca_copy, host_uid, host_uid, follow_symlinks=False)
    proxy = spawn_proxy(sock, policy, log_path, run_as, stderr_file=log_path.with_suffix(".stderr"))
    try:
        # Recorded so a restarted launcher ends it if this one dies (release_task_env).
        record_proxy(socket_dir.parent, proxy.pid)
        os.chown(sock, host_uid, host_uid, follow_symlinks=False)
    except BaseException:
        proxy.stop(grace=1.0)
        raise
    mount = BindMount(source=ca_dir, target=CA_DIR_IN_SANDBOX, read_only=True)
    return Egress(proxy=proxy, env=proxy_env(EGRESS_PORT, CA_IN_SANDBOX), mount=mount)
