"""An httpx transport to a unix socket that closes its socket when ``connect()`` fails.

httpcore 1.0.9's sync ``connect_unix_socket`` creates the socket inside its
error mapping and never closes it when ``connect()`` raises: every refused
attempt (nobody listening yet, no socket file) leaves a socket to the garbage
collector, a ``ResourceWarning`` each. A client that rides through a restart of
the server it talks to (:class:`agentbox.launcher.client.LauncherClient`)
retries exactly that way. httpx's ``HTTPTransport`` takes no network backend,
so :class:`UnixTransport` is the few lines of it we need: httpcore's public
``ConnectionPool`` with our :class:`_UnixBackend` (httpcore's public
``NetworkBackend`` interface), httpcore's errors translated to httpx's at this
boundary. Plain HTTP only: there is no TLS on a local socket::

    with httpx.Client(transport=unix_transport(path), base_url="http://launcher") as c:
        c.get("/v1/tasks")
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx

__all__ = ["UnixTransport", "unix_transport"]

# Most specific first: the first class an httpcore error is an instance of wins.
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.ProxyError, httpx.ProxyError),
)


def _translated(exc: Exception) -> Exception:
    for theirs, ours in _ERRORS:
        if isinstance(exc, theirs):
            return ours(str(exc))
    return exc


class _Stream(httpcore.NetworkStream):
    """A connected unix socket, its errors as httpcore's."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self._sock.settimeout(timeout)
            return self._sock.recv(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    def close(self) -> None:
        self._sock.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("no TLS over a unix socket")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            # An idle kept-alive connection that is readable was closed by the peer.
            if self._sock.fileno() < 0:
                return True
            poller = select.poll()  # not select(): no FD_SETSIZE limit
            poller.register(self._sock, select.POLLIN)
            return bool(poller.poll(0))
        return None


class _UnixBackend(httpcore.NetworkBackend):
    """Unix-socket connects that close the socket when they fail."""

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol(f"TCP to {host}:{port} on a unix-socket transport")

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(timeout)
            sock.connect(path)
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(f"{path}: {exc}") from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(f"{path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return _Stream(sock)


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except Exception as exc:
            mapped = _translated(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if callable(close):
            close()


class UnixTransport(httpx.BaseTransport):
    """Plain HTTP/1.1 to the unix socket at ``path``; ``limits`` as httpx's."""

    def __init__(self, path: Path | str, *, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits()
        self.path = str(path)
        self._pool = httpcore.ConnectionPool(
            uds=self.path,
            network_backend=_UnixBackend(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            resp = self._pool.handle_request(req)
        except Exception as exc:
            mapped = _translated(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        assert isinstance(resp.stream, Iterable)
        return httpx.Response(
            status_code=resp.status,
            headers=resp.headers,
            stream=_Body(resp.stream),
            extensions=resp.extensions,
        )

    def close(self) -> None:
        self._pool.close()


def unix_transport(path: Path | str, *, keepalive: bool = True) -> UnixTransport:
    """A transport to ``path``; ``keepalive=False`` keeps no connection between requests
    (one kept to a server that has since restarted would be dead)."""
    limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
    return UnixTransport(path, limits=limits)
