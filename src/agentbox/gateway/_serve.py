"""Listening sockets and the server loop for the gateway and the standalone replay model.

Sockets are made here, not by uvicorn: uvicorn chmods a unix socket it creates
to 0666, and the gateway's socket must be 0660 or tighter (only the sandbox's
relay and the launcher may connect). A TCP listener is refused anywhere but
loopback: the gateway is never a network service.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn

from agentbox.core.log import get_logger
from agentbox.errors import ConfigError, PolicyRefused
from agentbox.gateway._conn import ConnLimits, GuardedHttpProtocol
from agentbox.gateway._listenfd import inherited_listener

log = get_logger(__name__)


class Listen:
    """A parsed ``unix:/path`` or ``tcp:127.0.0.1:PORT`` address."""

    def __init__(self, kind: str, path: Path | None = None, host: str = "", port: int = 0):
        self.kind = kind
        self.path = path
        self.host = host
        self.port = port

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.host}:{self.port}"


def parse_listen(spec: str) -> Listen:
    """Parse a listen address; :class:`PolicyRefused` for TCP off loopback."""
    if spec.startswith("unix:"):
        path = spec[5:]
        if not path:
            raise ConfigError("listen: unix: needs a path")
        return Listen("unix", path=Path(path).absolute())
    if spec.startswith("tcp:"):
        host, sep, port_s = spec[4:].rpartition(":")
        host = host.strip("[]")
        if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise ConfigError(f"listen: bad tcp address {spec!r} (tcp:127.0.0.1:PORT)")
        if host == "localhost":
            host = "127.0.0.1"
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise PolicyRefused(f"listen: {host!r} is not a loopback address") from None
        if not addr.is_loopback:
            raise PolicyRefused(f"listen: refusing to listen on {host}: only loopback is allowed")
        return Listen("tcp", host=host, port=int(port_s))
    raise ConfigError(f"listen: {spec!r} must be unix:/path or tcp:127.0.0.1:PORT")


def bind(listen: Listen) -> socket.socket:
    """Create the listening socket (unix sockets mode 0660, created under a tight umask),
    or take the one the launcher bound at that path and passed down (:mod:`._listenfd`)."""
    if listen.kind == "unix":
        assert listen.path is not None
        inherited = inherited_listener(listen.path)
        if inherited is not None:  # bound (0660) by the launcher: spawn_gateway
            return inherited
        with contextlib.suppress(FileNotFoundError):
            if listen.path.is_socket():
                listen.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)
        try:
            sock.bind(str(listen.path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {listen}: {exc}") from exc
        finally:
            os.umask(old)
        listen.path.chmod(0o660)
    else:
        family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio turns on TCP_NODELAY only for sockets whose proto
        # says TCP, and without it Nagle + delayed ACKs add 40 ms to keep-alive requests.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((listen.host, listen.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {listen}: {exc}") from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


#: How often a server's shutdown checks that its connections have closed (uvicorn's own
#: loop checks every 0.1 s and pauses 0.1 s first: 0.2-0.3 s of every task's stop).
_SHUTDOWN_POLL = 0.005
#: Seconds the servers get to accept connections before ``ready`` is given up.
_READY_TIMEOUT = 10.0


class _Server(uvicorn.Server):
    """A uvicorn server that stops as soon as it is told to.

    uvicorn notices ``should_exit`` on a 0.1 s tick, then pauses 0.1 s after asking
    its connections to close and polls them every 0.1 s: a gateway with no request
    in flight took 0.3-0.5 s to stop, on the critical path of every task's end.
    Here :meth:`wake` ends the wait at once, and the shutdown polls its connections
    every few milliseconds; what it waits for is unchanged (in-flight responses
    finish, up to ``timeout_graceful_shutdown``, then the lifespan shutdown, which
    writes the gateway's usage file a last time).
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake = asyncio.Event()
        #: Set once :meth:`startup` has made the server accept connections.
        self.accepting = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.accepting.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Signals are handled once for all servers of the process (see serve()).
        yield

    def wake(self) -> None:
        """Stop now (on the event loop's thread): :meth:`main_loop` returns at once."""
        self.should_exit = True
        self._wake.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's own shutdown, with its fixed pause and 0.1 s polls made short.
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            await asyncio.wait_for(self._drain(), timeout=self.config.timeout_graceful_shutdown)
        except TimeoutError:
            log.error("graceful shutdown timed out: cancelling",
                      tasks=len(self.server_state.tasks))  # fmt: skip
            for t in self.server_state.tasks:
                t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drain(self) -> None:
        """Wait for the connections to finish their responses and close, then the tasks
        (uvicorn's server state has no event to wait on: polled)."""
        while self.server_state.connections and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(_SHUTDOWN_POLL)
        while self.server_state.tasks and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(_SHUTDOWN_POLL)
        for server in self.servers:
            await server.wait_closed()


#: Whether uvicorn's logging configuration was applied in this process (or the template
#: it was forked from): ``logging.config.dictConfig`` is ~0.5 ms a server, twice in every
#: gateway's start, and gives the same loggers every time.
_logging_configured = False


def _config(app: Any, limits: ConnLimits) -> uvicorn.Config:
    global _logging_configured
    if _logging_configured:
        log_config = None
        # What dictConfig would do again: its handler writes to the sys.stderr of now
        # (the gateway's capped log, set after the template configured it).
        for handler in logging.getLogger("uvicorn").handlers:
            if type(handler) is logging.StreamHandler:
                handler.setStream(sys.stderr)
    else:
        log_config = uvicorn.config.LOGGING_CONFIG
        _logging_configured = True
    cfg = uvicorn.Config(
        app,
        log_config=log_config,
        http=GuardedHttpProtocol,
        ws="none",  # no WebSocket: an upgrade request is answered as plain HTTP
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=75,
        timeout_graceful_shutdown=3,
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )
    # Read by GuardedHttpProtocol: header/body timeouts and the connection cap.
    cfg.conn_limits = limits  # type: ignore[attr-defined]
    return cfg


class ServerGroup:
    """uvicorn servers sharing one event loop (a gateway and its in-process upstream).

    ``limits``: connection limits of the *last* app's server (the gateway, what the
    sandbox reaches); the others get the defaults with counts of their own.
    """

    def __init__(
        self, apps: list[tuple[Any, socket.socket]], limits: ConnLimits | None = None
    ) -> None:
        self.apps = apps
        self.limits = [ConnLimits() for _ in apps]
        if limits is not None and apps:
            self.limits[-1] = limits
        self.servers = [
            _Server(_config(app, lim)) for (app, _), lim in zip(apps, self.limits, strict=True)
        ]
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        """Ask every server to shut down gracefully (safe from another thread)."""
        for s in self.servers:
            s.should_exit = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        wake = [s.wake for s in self.servers]
        if running is loop:
            for w in wake:
                w()
        else:  # another thread (a test's): the event belongs to the loop's thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                for w in wake:
                    loop.call_soon_threadsafe(w)

    @property
    def started(self) -> bool:
        """Every server is accepting connections."""
        return all(s.started for s in self.servers)

    async def run(
        self, *, signals: bool = True, ready_fd: int | None = None, exit_at: float | None = None
    ) -> None:
        """Serve until stopped (SIGTERM/SIGINT with ``signals``, or unix time ``exit_at``),
        then shut down.

        ``ready_fd``: once every server accepts connections, ``ready`` is written to
        this file descriptor and it is closed (how :func:`spawn_gateway` knows).
        """
        loop = self._loop = asyncio.get_running_loop()
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        if exit_at is not None:
            loop.call_later(max(0.0, exit_at - time.time()), self.stop)
        try:
            # The sockets already listen (bind() did), so clients queue until serving starts.
            tasks = [
                asyncio.ensure_future(server.serve(sockets=[sock]))
                for server, (_, sock) in zip(self.servers, self.apps, strict=True)
            ]
            if ready_fd is not None:
                # Told at once (a 5 ms poll here was a quarter of a forked gateway's start).
                accepting: asyncio.Future[Any] = asyncio.gather(
                    *(s.accepting.wait() for s in self.servers)
                )
                waits: list[asyncio.Future[Any]] = [accepting, *tasks]
                await asyncio.wait(waits, timeout=_READY_TIMEOUT,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                accepting.cancel()
                # The launcher may be gone (killed while we started): the task's sandbox
                # may already run and still needs us, so a closed pipe is no reason to die.
                if self.started:
                    with contextlib.suppress(OSError):
                        os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            self.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            for _, sock in self.apps:
                sock.close()


async def serve(apps: list[tuple[Any, socket.socket]]) -> None:
    """Serve each app on its socket until SIGTERM/SIGINT, then shut all down gracefully."""
    await ServerGroup(apps).run()


def private_socket() -> tuple[socket.socket, str]:
    """A listening socket for an in-process upstream, in the abstract namespace.

    An abstract unix socket leaves nothing on disk, so a gateway that is killed
    leaves no directory behind. It has no file permissions: any process in the
    host's network namespace could connect, by its random 128-bit name, and talk to
    the replay model, which holds no secret and meters nothing. The sandbox is in
    a network namespace of its own and cannot reach it.
    """
    name = "\0agentbox-replay-" + secrets.token_hex(16)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    sock.listen(1024)
    sock.setblocking(False)
    return sock, name
