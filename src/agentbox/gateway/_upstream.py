"""The gateway's upstream client behind one small interface: :func:`make_pool`.

Every upstream, ``http://``, ``https://`` or a unix socket, is reached through
:class:`~agentbox.gateway._plain.PlainPool`: keep-alive HTTP/1.1 on asyncio
streams parsed by llhttp (``httptools``), over the standard library's verifying TLS for
``https://`` (not httpx's transport: it cost ~6 MiB more per task for the same
HTTP/1.1). :class:`Pool` and :class:`UpstreamResponse`
are the interface the gateway uses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

from agentbox.errors import ConfigError
from agentbox.gateway._plain import PlainPool


class UpstreamResponse(Protocol):
    """What the gateway needs of an upstream response."""

    status: int

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (lower case), if present."""

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as it arrives (transfer coding removed)."""

    async def aclose(self) -> None:
        """Release the connection (closing it if the body was not read to the end)."""

    def abort(self) -> None:
        """Drop the connection now unless the body was read to the end (the client left):
        a read waiting on it ends at once."""


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
    """The pool for an upstream: ``http(s)://host[:port][/prefix]``, or HTTP over the unix
    socket ``uds`` (the URL's host then only names the ``Host`` header)."""
    try:
        url = urlsplit(base_url)
        host, port = url.hostname or "", url.port
    except ValueError as exc:
        raise ConfigError(f"upstream URL {base_url!r}: {exc}") from None
    tls = uds is None and url.scheme == "https"
    if uds is None and url.scheme not in ("http", "https"):
        raise ConfigError(f"upstream URL {base_url!r}: use http:// or https://")
    return PlainPool(
        host=host,
        port=port or (443 if tls else 80),
        uds=uds,
        host_header=host if port is None else f"{host}:{port}",
        prefix=url.path.rstrip("/"),
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        tls=tls,
    )
