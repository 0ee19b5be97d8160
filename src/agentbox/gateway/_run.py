"""Run a gateway or a standalone replay model in this process (what the CLI calls)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from agentbox.core.exit import end_process
from agentbox.core.log import get_logger
from agentbox.errors import ConfigError
from agentbox.gateway._app import Gateway, GatewayConfig
from agentbox.gateway._confine import confine, limit_resources
from agentbox.gateway._conn import ConnLimits
from agentbox.gateway._handshake import write_handshake
from agentbox.gateway._replay import ReplayModel
from agentbox.gateway._script import load_script
from agentbox.gateway._serve import ServerGroup, bind, parse_listen, private_socket, serve
from agentbox.gateway.registry import ModelEntry
from agentbox.linux.libc import libc
from agentbox.linux.privdrop import drop_to

log = get_logger(__name__)


def read_token(*, token: str | None, token_file: Path | None) -> str:
    """The task token from ``--token`` or ``--token-file`` (exactly one)."""
    if (token is None) == (token_file is None):
        raise ConfigError("give exactly one of --token or --token-file")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read token file {token_file}: {exc}") from exc
    assert token is not None
    if len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError("the token must be at least 16 printable ASCII characters, no spaces")
    return token


def build_gateway(
    *,
    listen: str,
    token: str,
    entry: ModelEntry,
    budget: int,
    budget_usd: float | None = None,
    upstream: str | None = None,
    key_env: str | None = None,
    usage_file: Path | None = None,
    max_body: int = 32 << 20,
    max_held: int = 64 << 20,
    max_concurrency: int = 16,
    max_connections: int = 128,
    header_timeout: float = 10.0,
    body_timeout: float = 120.0,
) -> tuple[ServerGroup, Gateway, Path | None]:
    """Bind the sockets and build the apps of one gateway (and its in-process replay model).

    ``upstream`` overrides the registry entry's: ``http(s)://…``, ``unix:/path`` (HTTP over a
    unix socket) or ``replay:SCRIPT`` (a replay model in this process, on a private socket).
    Returns the server group, the gateway app, and the private directory to remove afterwards.
    """
    if budget < 1:
        raise ConfigError("--budget must be at least 1")
    if budget_usd is not None:
        if not budget_usd > 0:
            raise ConfigError("--budget-usd must be more than 0")
        if entry.price is None:
            raise ConfigError(
                f"--budget-usd: model {entry.name!r} has no price in the registry "
                f"(add [models.{entry.name}.price])"
            )
    if min(max_concurrency, max_body, max_connections) < 1:
        raise ConfigError("--max-concurrency, --max-body and --max-connections must be positive")
    if min(header_timeout, body_timeout) <= 0:
        raise ConfigError("--header-timeout and --body-timeout must be positive")
    target = upstream or (f"replay:{entry.upstream}" if entry.kind == "replay" else entry.upstream)
    lst = parse_listen(listen)
    apps: list[tuple[Any, Any]] = []
    uds: str | None = None
    replay_dir: Path | None = None
    env_name = key_env or entry.key_env
    key: str | None = None
    if target.startswith("replay:"):
        script = load_script(Path(target[7:]))
        rsock, uds = private_socket()
        apps.append((ReplayModel(script), rsock))
        base = "http://replay"
    elif target.startswith("unix:"):
        base, uds = "http://upstream", target[5:]
    elif target.startswith(("http://", "https://")):
        base = target.rstrip("/")
    else:
        raise ConfigError(f"--upstream {target!r}: use http(s)://…, unix:/path or replay:SCRIPT")
    if env_name and not target.startswith("replay:"):
        key = os.environ.get(env_name)
        if not key and entry.kind == "anthropic":
            raise ConfigError(
                f"model {entry.name!r} needs an API key in the environment variable {env_name}"
            )
    cfg = GatewayConfig(
        token=token,
        entry=entry,
        upstream_url=base,
        upstream_uds=uds,
        upstream_key=key,
        budget=budget,
        budget_usd=budget_usd,
        usage_file=usage_file,
        max_body=max_body,
        max_held=max(max_held, max_body),
        max_concurrency=max_concurrency,
    )
    gateway = Gateway(cfg)
    apps.append((gateway, bind(lst)))
    limits = ConnLimits(
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        max_connections=max_connections,
        notify=gateway.count_refusal,
    )
    return ServerGroup(apps, limits), gateway, replay_dir


def parse_user(spec: str) -> tuple[int, int]:
    """``UID`` or ``UID:GID`` (numbers) for ``--user``."""
    uid_s, _, gid_s = spec.partition(":")
    if not uid_s.isdigit() or (gid_s and not gid_s.isdigit()):
        raise ConfigError(f"--user {spec!r}: use numeric UID or UID:GID")
    uid = int(uid_s)
    return uid, int(gid_s) if gid_s else uid


def run_gateway(
    *,
    listen: str,
    run_as: tuple[int, int] | None = None,
    ready_fd: int | None = None,
    max_memory: int | None = None,
    max_file: int | None = None,
    exit_at: float | None = None,
    **kwargs: Any,
) -> None:
    """Serve a gateway for one task until SIGTERM (arguments as :func:`build_gateway`),
    then end the process (no return once it served: :func:`_end_process`).

    ``run_as``: once the sockets are bound, empty the capability bounding set, drop
    to this uid/gid, set ``no_new_privs`` and load the seccomp filter
    (:mod:`._confine`). The gateway is the component that parses what the sandbox
    sends; it should hold nothing while doing so. The usage file's directory must
    then be writable by that uid (it is written through a descriptor opened now).
    ``max_memory`` / ``max_file``: ``RLIMIT_AS`` / ``RLIMIT_FSIZE`` in bytes.
    ``ready_fd``: written ``ready`` and closed once serving (after the drop).
    ``exit_at``: stop as SIGTERM would (usage written) at this unix time, whoever is
    left to stop it (live restore: a task's gateway outlives its launcher, not its deadline).
    """
    group, gateway, replay_dir = build_gateway(listen=listen, **kwargs)
    if (usage := kwargs.get("usage_file")) is not None:
        write_handshake(Path(usage).parent)  # before the drop: what an adopter checks
    if run_as is not None:
        # Load now what would otherwise be imported lazily: after the drop, the
        # interpreter's own files may not be readable (a Python under /root).
        import concurrent.futures.thread  # noqa: F401  (the usage writer's executor)

        for server in group.servers:
            server.config.load()
        gateway.prepare_for_drop()
        own = [replay_dir, replay_dir / "replay.sock"] if replay_dir is not None else []
        drop_to(*run_as, own=own)
        confine()
    limit_resources(max_memory=max_memory, max_file=max_file)
    log.info("gateway listening", listen=listen, model=gateway.cfg.entry.name)
    try:
        asyncio.run(_serve_trimmed(group, ready_fd=ready_fd, exit_at=exit_at))
    finally:
        gateway.write_usage()
        if replay_dir is not None:
            shutil.rmtree(replay_dir, ignore_errors=True)
        lst = parse_listen(listen)
        if lst.path is not None:
            with contextlib.suppress(OSError):
                lst.path.unlink()
    _end_process()


#: Seconds after the start when the heap's free pages are handed back (start-up done).
TRIM_AFTER = 1.0


async def _serve_trimmed(group: ServerGroup, **kwargs: Any) -> None:
    """``group.run(**kwargs)``, and once started, glibc's free heap pages returned to the
    kernel (``malloc_trim``): what the start built and dropped would otherwise stay
    resident, private to each gateway (a forked one's first writes copied those pages)."""
    asyncio.get_running_loop().call_later(TRIM_AFTER, _trim_heap)
    await group.run(**kwargs)


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc().malloc_trim(0)


def _end_process() -> NoReturn:
    """End the gateway process now that it has stopped: its usage file is final and its
    sockets closed; the logs are flushed (:func:`agentbox.core.exit.end_process`).

    The interpreter's own teardown (freeing every module's objects) took 0.2-0.3 s of
    CPU after that, with nothing left to do, on the critical path of every task's end
    (the launcher waits for its gateway to exit before the task is collected).
    """
    end_process(0)


def run_replay(
    *,
    script: Path,
    listen: str,
    log_path: Path | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serve the replay model alone until SIGTERM.

    ``on_listening`` gets the bound address (``tcp:HOST:PORT`` with the real port when
    ``PORT`` was 0, or ``unix:PATH``) once the socket accepts connections.
    """
    model = ReplayModel(load_script(script), log_path=log_path)
    sock = bind(parse_listen(listen))
    if on_listening is not None:
        name = sock.getsockname()
        if isinstance(name, tuple):
            host = f"[{name[0]}]" if ":" in name[0] else name[0]
            on_listening(f"tcp:{host}:{name[1]}")
        else:
            on_listening(f"unix:{name}")
    try:
        asyncio.run(serve([(model, sock)]))
    finally:
        lst = parse_listen(listen)
        if lst.path is not None:
            with contextlib.suppress(OSError):
                lst.path.unlink()
