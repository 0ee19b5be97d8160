"""The gateway's client for ``https://`` upstreams (the Anthropic API): httpx's transport.

There network latency dwarfs CPU, and TLS is not something to hand-roll. Imported
only by a gateway whose upstream is ``https://``: httpx and its first-request
modules are ~4 MiB a replay or local-model gateway does not need (issue 15).
"""

from __future__ import annotations

import contextlib
import importlib
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx

from agentbox.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from agentbox.gateway._upstream import UpstreamResponse

__all__ = ["HttpxPool"]


class _HttpxResponse:
    def __init__(self, resp: httpx.Response, pool: HttpxPool, t: httpx.AsyncHTTPTransport):
        self._resp, self._pool, self._t = resp, pool, t
        self.status = resp.status_code
        self._closed = False

    def header(self, name: str) -> str | None:
        value: str | None = self._resp.headers.get(name)
        return value

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            raise UpstreamTimeout("upstream read timed out") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream connection broke: {type(exc).__name__}") from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await self._resp.aclose()
            finally:
                self._pool._idle.append(self._t)


#: Modules httpx imports lazily on its first request (measured with httpx 0.28).
_FIRST_REQUEST_MODULES = (
    "concurrent.futures.thread",  # asyncio resolves names in its default executor
    "httpcore",
    "sniffio",
    "anyio",
    "anyio.lowlevel",
    "anyio.to_thread",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
    "anyio._backends._asyncio",
)


class HttpxPool:
    """httpx transports, one per connection (httpcore's pool scans every connection per
    request); no ``AsyncClient``: no cookies, no redirects, no proxy from the environment."""

    def __init__(self, *, base_url: str, connect_timeout: float, read_timeout: float) -> None:
        self.base_url = base_url
        self._timeouts = {"connect": connect_timeout, "read": read_timeout,
                          "write": 60.0, "pool": 60.0}  # fmt: skip
        self._ssl: ssl.SSLContext | None = None
        self._all: list[httpx.AsyncHTTPTransport] = []
        self._idle: list[httpx.AsyncHTTPTransport] = []

    def prepare(self) -> None:
        """Build the verifying SSL context now (it reads the CA bundle from disk), and
        import what httpx imports on its first request (httpcore, anyio's asyncio
        backend): a gateway that dropped its privileges may not read its own
        interpreter's files any more (a Python under ``/root``)."""
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        for name in _FIRST_REQUEST_MODULES:
            importlib.import_module(name)

    def _take(self) -> httpx.AsyncHTTPTransport:
        if self._idle:
            return self._idle.pop()
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # one verifying context: ~40 ms each
        t = httpx.AsyncHTTPTransport(
            verify=self._ssl,
            retries=0,
            trust_env=False,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self._all.append(t)
        return t

    async def request(
        self, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        req = httpx.Request("POST", self.base_url + path, headers=headers, content=body,
                            extensions={"timeout": self._timeouts})  # fmt: skip
        t = self._take()
        try:
            resp = await t.handle_async_request(req)
        except httpx.TimeoutException:
            self._idle.append(t)
            raise UpstreamTimeout("upstream timed out") from None
        except httpx.HTTPError as exc:
            self._idle.append(t)
            raise UpstreamConnectError(f"upstream unreachable: {type(exc).__name__}") from None
        return _HttpxResponse(resp, self, t)

    async def aclose(self) -> None:
        for t in self._all:
            with contextlib.suppress(Exception):
                await t.aclose()
        self._all.clear()
        self._idle.clear()
