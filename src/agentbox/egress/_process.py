"""The proxy as a process of its own: :func:`spawn_proxy` on the host, :func:`run_proxy` in it.

Like the gateway, the proxy runs as ``python -m agentbox.egress`` in its own
session, so ``stop()`` can signal its whole group. Its policy travels as JSON on
its standard input (nothing on argv but paths). It binds its unix socket (0660)
and opens its log as the starting user, then, with ``run_as``, empties the
capability bounding set, drops to that uid/gid, sets ``no_new_privs`` and loads
the gateway's seccomp filter (:mod:`agentbox.gateway._confine`), and serves under
``RLIMIT_AS`` and ``RLIMIT_FSIZE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from agentbox.core.log import get_logger
from agentbox.core.service import ServiceHandle, wait_ready
from agentbox.egress._intercept import Interceptor
from agentbox.egress._policy import EgressPolicy
from agentbox.egress._proxy import EgressProxy
from agentbox.egress._record import EgressLog
from agentbox.egress.rules import NetworkRule, rule_hosts, secret_names
from agentbox.errors import EgressError, GatewayError

log = get_logger(__name__)

#: ``RLIMIT_AS`` of the proxy process: an interpreter, its resolver threads and
#: 32 connections' 64 KiB buffers fit well within it.
DEFAULT_MAX_MEMORY = 512 << 20
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "AGENTBOX_LOG_LEVEL", "AGENTBOX_LOG_JSON")
_MAX_POLICY = 1 << 20


async def _serve(proxy: EgressProxy, sock: socket.socket, ready_fd: int | None) -> None:
    server = await asyncio.start_unix_server(proxy.handle, sock=sock, limit=65536)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    try:
        await stop.wait()
    finally:
        server.close()
        await proxy.aclose()


def read_secrets(fd: int) -> dict[str, str]:
    """The secret values the launcher wrote to the inherited ``fd`` (JSON), then closed."""
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(_MAX_POLICY + 1)
    if len(data) > _MAX_POLICY:
        raise EgressError("secret values larger than 1 MiB")
    try:
        values = json.loads(data or b"{}")
    except ValueError:
        raise EgressError("bad secret values on the inherited descriptor") from None
    if not isinstance(values, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in values.items()
    ):
        raise EgressError("bad secret values on the inherited descriptor")
    return values


def make_interceptor(
    policy: EgressPolicy, secret_values: dict[str, str], ca_out: Path | None
) -> Interceptor | None:
    """The request-level side (a task CA, the upstream check) when the policy has rules.

    The CA's certificate is written to ``ca_out`` (its key stays in this process).
    """
    rules = policy.network_rules
    if not rules:
        return None
    from agentbox.egress._tls import TaskCA, upstream_context

    missing = [n for n in secret_names(rules) if n not in secret_values]
    if missing:
        raise EgressError(f"no value for the secret(s) {', '.join(missing)} the rules inject")
    try:
        upstream = upstream_context(policy.upstream_ca)
    except (OSError, ssl.SSLError) as exc:
        raise EgressError(f"cannot load egress_upstream_ca {policy.upstream_ca}: {exc}") from exc
    ca = TaskCA(rule_hosts(rules))
    if ca_out is not None:
        fd = os.open(ca_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(ca.cert_pem)
    try:
        return Interceptor(rules, ca, upstream, secret_values, policy.phase)
    except (ValueError, KeyError) as exc:
        raise EgressError(f"cannot prepare the rules' headers: {exc}") from None


def run_proxy(
    *,
    socket_path: Path,
    policy: EgressPolicy,
    log_path: Path,
    run_as: tuple[int, int] | None = None,
    ready_fd: int | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    secret_values: dict[str, str] | None = None,
    ca_out: Path | None = None,
) -> None:
    """Serve one task's proxy on ``socket_path`` until SIGTERM (what the child runs)."""
    from agentbox.gateway._confine import confine, limit_resources
    from agentbox.gateway._serve import bind, parse_listen
    from agentbox.linux.privdrop import drop_to

    interceptor = make_interceptor(policy, secret_values or {}, ca_out)
    try:
        record = EgressLog(log_path, max_bytes=policy.limits.max_log_bytes)
    except OSError as exc:
        raise EgressError(f"cannot open the egress log {log_path}: {exc.strerror}") from exc
    proxy = EgressProxy(policy, record, interceptor=interceptor)
    try:
        sock = bind(parse_listen(f"unix:{socket_path}"))
        if run_as is not None:
            # Load now what would be loaded lazily after the drop: the resolver's
            # executor threads and the IDNA codec getaddrinfo encodes names with.
            import concurrent.futures.thread  # noqa: F401

            "x".encode("idna")
            try:
                drop_to(*run_as)
                confine()
            except GatewayError as exc:
                raise EgressError(str(exc).replace("gateway", "egress proxy")) from exc
        limit_resources(max_memory=max_memory, max_file=policy.limits.max_log_bytes + 4096)
        log.info("egress proxy listening", socket=str(socket_path), hosts=list(policy.hosts))
        asyncio.run(_serve(proxy, sock, ready_fd))
    finally:
        record.close()
        with contextlib.suppress(OSError):
            socket_path.unlink()


def _wait_ready(fd: int, timeout: float) -> None:
    """Wait for the child's ``ready`` line; EgressError if it closes the pipe or is late."""
    wait_ready(fd, timeout, what="egress proxy", error=EgressError)


class ProxyHandle(ServiceHandle):
    """A running proxy process: ``pid``, ``alive()``, ``stop()`` (idempotent), a context manager.

    On TERM the proxy ends its connections, logs each and closes its log.
    """

    def __init__(self, proc: subprocess.Popen[bytes], *, socket_path: Path, log_path: Path):
        super().__init__(proc, socket_path=socket_path)
        self.log_path = log_path
        self.ca_cert: bytes | None = None
        """The task CA's certificate (PEM) when the proxy terminates TLS for rule hosts."""


def spawn_proxy(
    socket_path: Path,
    policy: EgressPolicy,
    log_path: Path,
    run_as: tuple[int, int] | None = None,
    *,
    stderr_file: Path | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    timeout: float = 20.0,
    rules: Sequence[NetworkRule] = (),
    secret_values: Mapping[str, str] | None = None,
) -> ProxyHandle:
    """Start a proxy for one task on ``socket_path`` and wait until it serves.

    The socket is mode 0660, owned by the starting user (chown it to let the
    sandbox's relay in, as for the gateway's); the log at ``log_path`` is appended
    to (JSON lines, see :mod:`._record`). ``run_as=(uid, gid)``: the proxy drops to
    that identity before serving (start as root; the launcher passes the gateway's
    dedicated identity). ``stderr_file`` receives the proxy's own diagnostics.
    Raises :class:`EgressError` (with the diagnostics' tail) if it does not serve
    within ``timeout`` seconds.

    ``rules`` are added to the policy's request-level rules; with any, the proxy makes a
    task CA (its certificate: ``handle.ca_cert``, written to ``<log_path>.ca.pem`` too) and
    terminates TLS for the hosts they name. ``secret_values`` (name → value, the secrets
    the rules inject) reach the proxy only through an inherited pipe, never argv, its
    environment, a file or a log.
    """
    if rules:
        policy = policy.with_rules(rules)
    values = dict(secret_values or {})
    missing = [n for n in secret_names(policy.network_rules) if n not in values]
    if missing:
        raise EgressError(f"no value for the secret(s) {', '.join(missing)} the rules inject")
    for name, value in values.items():
        if any(c in value for c in "\r\n\0"):
            raise EgressError(f"the secret {name} has a line break or NUL: not a header value")
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["MALLOC_ARENA_MAX"] = "2"  # under RLIMIT_AS: not one 64 MiB arena per resolver thread
    # asyncio's TLS reads allocate 256 KiB per TLS record (16 KiB of data): with glibc's
    # defaults each such buffer grew and trimmed the heap (brk) or was an mmap, about a
    # tenth of the intercepting proxy's CPU (py-spy). Keep big buffers on the heap and
    # the freed top of it for reuse (at most 8 MiB held back).
    env["MALLOC_MMAP_THRESHOLD_"] = str(4 << 20)
    env["MALLOC_TRIM_THRESHOLD_"] = str(8 << 20)
    ready_r, ready_w = os.pipe()
    argv = [sys.executable, "-m", "agentbox.egress", "--socket", str(socket_path)]
    argv += ["--log", str(log_path), "--ready-fd", str(ready_w)]
    if run_as is not None:
        argv += ["--user", f"{run_as[0]}:{run_as[1]}"]
    argv += ["--max-memory", str(max_memory or 0)]
    ca_out: Path | None = None
    pass_fds = [ready_w]
    secrets_r = secrets_w = -1
    if policy.network_rules:
        ca_out = log_path.with_name(log_path.name + ".ca.pem")
        with contextlib.suppress(FileNotFoundError):
            ca_out.unlink()
        secrets_r, secrets_w = os.pipe()
        pass_fds.append(secrets_r)
        argv += ["--ca-out", str(ca_out), "--secrets-fd", str(secrets_r)]
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    out: IO[bytes] | int = stderr_file.open("ab") if stderr_file is not None else subprocess.DEVNULL
    log.info("spawn egress proxy", argv=argv, hosts=list(policy.hosts))
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        os.close(ready_w)
        if secrets_r >= 0:
            os.close(secrets_r)
        if not isinstance(out, int):
            out.close()
    handle = ProxyHandle(proc, socket_path=socket_path, log_path=log_path)
    try:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(policy.model_dump_json().encode())
            proc.stdin.close()
        if secrets_w >= 0:
            # The child reads it right after the policy; a pipe holds 64 KiB, and more
            # is written while it reads. Never a file, argv or the environment.
            with contextlib.suppress(BrokenPipeError), os.fdopen(secrets_w, "wb") as fh:
                secrets_w = -1
                fh.write(json.dumps(values).encode())
        # "ready" comes once the server accepts (and after the drop): no probe connection.
        _wait_ready(ready_r, timeout)
        if ca_out is not None:
            handle.ca_cert = ca_out.read_bytes()
    except (EgressError, OSError) as exc:
        handle.stop(grace=1.0)
        tail = ""
        if stderr_file is not None:
            with contextlib.suppress(OSError):
                lines = stderr_file.read_text(errors="replace").splitlines()[-20:]
                tail = "\n" + "\n".join(lines)
        raise EgressError(f"{exc}{tail}") from exc
    finally:
        os.close(ready_r)
        if secrets_w >= 0:
            os.close(secrets_w)
    return handle


def read_policy(stream: IO[bytes]) -> EgressPolicy:
    """The policy JSON from ``stream`` (bounded), for the child."""
    data = stream.read(_MAX_POLICY + 1)
    if len(data) > _MAX_POLICY:
        raise EgressError("egress policy larger than 1 MiB")
    try:
        return EgressPolicy.model_validate_json(data)
    except ValueError as exc:
        raise EgressError(f"bad egress policy on stdin: {exc}") from exc
