"""The gateway's upstream clients behind one small interface: :func:`make_pool`.

- ``http://`` and unix-socket upstreams (the replay model, llama.cpp, vLLM on
  127.0.0.1): :class:`~agentbox.gateway._plain.PlainPool`, keep-alive HTTP/1.1 on
  asyncio streams framed by h11 (cheap per request, where the gateway's own CPU
  shows);
- ``https://`` upstreams (the Anthropic API): :class:`~agentbox.gateway._tls.HttpxPool`,
  httpx's transport with a verifying TLS context, imported only then.

Both give the same small response interface (:class:`UpstreamResponse`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from agentbox.errors import ConfigError, UpstreamConnectError, UpstreamError, UpstreamTimeout
from agentbox.gateway._plain import PlainPool

if TYPE_CHECKING:
    from agentbox.gateway._tls import HttpxPool

__all__ = [
    "HttpxPool",
    "PlainPool",
    "Pool",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "make_pool",
]


class UpstreamResponse(Protocol):
    """What the gateway needs of an upstream response."""

    status: int

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (lower case), if present."""

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as it arrives (transfer coding removed)."""

    async def aclose(self) -> None:
        """Release the connection (closing it if the body was not read to the end)."""


class Pool(Protocol):
    """An upstream connection pool."""

    async def request(
        self, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """POST ``body`` to ``path``; the response head has arrived when this returns."""

    async def aclose(self) -> None:
        """Close every connection."""

    def prepare(self) -> None:
        """Read from disk now whatever the pool would read lazily (before a privilege drop)."""


def make_pool(
    base_url: str, uds: str | None, *, connect_timeout: float, read_timeout: float
) -> Pool:
    """The pool for an upstream: plain HTTP/1.1 for ``http://`` and unix sockets, else httpx."""
    try:
        url = urlsplit(base_url)
        host, port = url.hostname or "", url.port
    except ValueError as exc:
        raise ConfigError(f"upstream URL {base_url!r}: {exc}") from None
    if uds is not None or url.scheme == "http":
        host_header = host if port is None else f"{host}:{port}"
        return PlainPool(
            host=host,
            port=port or 80,
            uds=uds,
            host_header=host_header,
            prefix=url.path.rstrip("/"),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
    from agentbox.gateway._tls import HttpxPool

    return HttpxPool(base_url=base_url.rstrip("/"), connect_timeout=connect_timeout,
                     read_timeout=read_timeout)  # fmt: skip


def __getattr__(name: str) -> Any:
    """:class:`HttpxPool`, imported on first use (it imports httpx)."""
    if name == "HttpxPool":
        from agentbox.gateway._tls import HttpxPool

        return HttpxPool
    raise AttributeError(name)
