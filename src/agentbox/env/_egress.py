"""Egress for one phase: the per-task proxy, its socket and CA bundle in the sandbox.

:func:`start_egress` starts a proxy (:mod:`agentbox.egress`) on ``<dir>/egress.sock``
for a phase; the sandbox gets that dir at ``/run/agentbox/gw`` (a container mounts
it; a microVM's guest agent serves the socket there over its channel), the host's
CA bundle read-only at ``/run/agentbox/ca/ca.pem``, and the proxy variables;
:func:`egress_argv` puts the in-sandbox relay (``127.0.0.1:3128`` to that socket)
in front of the phase's command.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX, BindMount
from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, proxy_env
from agentbox.env._report import record_proxy
from agentbox.errors import PolicyRefused

if TYPE_CHECKING:
    from agentbox.egress import ProxyHandle
    from agentbox.egress.rules import NetworkRule

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


def rule_secrets(
    settings: Settings,
    rules: Sequence[NetworkRule],
    owner_uid: int | None,
    known: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The values of the secrets ``rules`` inject: ``known`` ones (the host's brokered
    credentials) as given, the rest the task owner's (or root's shared) from the store.

    :class:`~agentbox.errors.SecretNotFound` names one that is not set. The values go to
    the proxy only (:func:`start_egress`).
    """
    from agentbox.egress.rules import secret_names

    values = dict(known or {})
    names = [n for n in secret_names(rules) if n not in values]
    if not names:
        return values
    from agentbox.secrets import resolve_for_task

    if owner_uid is None:  # never the launcher's own (root's) secrets by default
        raise PolicyRefused(
            f"the task's submitter is not recorded, so its secrets ({', '.join(names)}) "
            "cannot be resolved: submit it again"
        )
    values.update(resolve_for_task(settings, owner_uid, ["${secret:" + n + "}" for n in names]))
    return values


def _write_bundle(ca_dir: Path, data: bytes, host_uid: int) -> None:
    """``ca_dir/ca.pem`` = ``data`` (0444, the sandbox uid's), replaced in one step."""
    tmp = ca_dir / ".ca.pem.new"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chown(tmp, host_uid, host_uid, follow_symlinks=False)
    tmp.replace(ca_dir / "ca.pem")


def start_egress(
    settings: Settings,
    policy: EgressPolicy,
    socket_dir: Path,
    log_path: Path,
    run_as: tuple[int, int] | None,
    *,
    secret_values: Mapping[str, str] | None = None,
) -> Egress:
    """Start a proxy on ``socket_dir/egress.sock`` (given to the sandbox uid).

    The host's CA bundle is copied next to ``socket_dir`` (``egress-ca/ca.pem``, 0444,
    the sandbox uid's: runsc's gofer can read it, and a host bundle replaced while the
    task runs changes nothing) and that directory is mounted read-only. When the policy
    has request-level rules, the proxy's task CA certificate is appended to that copy
    (the sandbox trusts the proxy for the rules' hosts, and only for them: the CA is
    name-constrained); ``secret_values`` are the secrets the rules inject
    (:func:`rule_secrets`), handed to the proxy through an inherited pipe.
    """
    from agentbox.egress import spawn_proxy  # the proxy's side: only a task that starts one

    sock = socket_dir / EGRESS_SOCKET_NAME
    ca_dir = socket_dir.parent / "egress-ca"
    host_uid = settings.sandbox_host_uid
    ca_dir.mkdir(mode=0o755, exist_ok=True)
    os.chown(ca_dir, host_uid, host_uid, follow_symlinks=False)
    bundle = host_ca_bundle(settings).read_bytes()
    proxy = spawn_proxy(
        sock,
        policy,
        log_path,
        run_as,
        stderr_file=log_path.with_suffix(".stderr"),
        secret_values=secret_values,
    )
    try:
        # Recorded so a restarted launcher ends it if this one dies (release_task_env).
        record_proxy(socket_dir.parent, proxy.pid)
        os.chown(sock, host_uid, host_uid, follow_symlinks=False)
        if proxy.ca_cert is not None:
            bundle = bundle.rstrip(b"\n") + b"\n" + proxy.ca_cert
        _write_bundle(ca_dir, bundle, host_uid)
    except BaseException:
        proxy.stop(grace=1.0)
        raise
    mount = BindMount(source=ca_dir, target=CA_DIR_IN_SANDBOX, read_only=True)
    return Egress(proxy=proxy, env=proxy_env(EGRESS_PORT, CA_IN_SANDBOX), mount=mount)
