"""Who is at the other end of the launcher's socket, read from the kernel before any byte.

Every accepted connection's credentials are read (``SO_PEERCRED``, and
``SO_PEERGROUPS`` for the supplementary groups: what the peer held when it called
``connect()``) in ``connection_made``, before the HTTP parser exists. Root, the
launcher's own uid, or a member of ``agentbox`` get an HTTP protocol; anything
else is aborted without a byte (:class:`PeerCheckedProtocol`, a wrapper around
uvicorn's h11 protocol passed as ``uvicorn.Config(http=...)``).
"""

from __future__ import annotations

import asyncio
import grp
import os
import struct
from typing import Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

from agentbox.core.log import get_logger
from agentbox.linux.peer import Peer, peer_of

log = get_logger(__name__)

SOCKET_GROUP = "agentbox"
#: The ASGI state key under which each connection's checked :class:`Peer` travels.
PEER_KEY = "agentbox_peer"


def group_gid() -> int | None:
    """The gid of the group ``agentbox`` (None when it does not exist)."""
    try:
        return grp.getgrnam(SOCKET_GROUP).gr_gid
    except KeyError:
        return None


# -- the peer ----------------------------------------------------------------------------


def may_connect(peer: Peer, group: int | None) -> bool:
    """Root, the launcher's own uid, or a member of ``group`` (primary or supplementary)."""
    if peer.uid in (0, os.geteuid()):
        return True
    return group is not None and (peer.gid == group or group in peer.groups)


class PeerCheckedProtocol(asyncio.Protocol):
    """uvicorn's h11 protocol behind a peer check (``uvicorn.Config(http=PeerCheckedProtocol)``).

    uvicorn builds one per connection with its usual keyword arguments; the check
    runs in :meth:`connection_made`, which asyncio calls before it starts reading,
    so a refused peer is aborted before a byte of its request is read and no HTTP
    parser is ever built for it. An allowed peer's :class:`Peer` is added to the
    ASGI ``state`` of each of its requests.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._inner: H11Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream transport: uvicorn's own cast
        sock = transport.get_extra_info("socket")
        try:
            peer: Peer | None = peer_of(sock, groups=True)
        except (OSError, struct.error) as exc:
            peer = None
            log.warning("connection refused: peer unknown", error=str(exc))
        if peer is None or not may_connect(peer, group_gid()):
            if peer is not None:
                log.warning(
                    "connection refused: not root and not in group agentbox",
                    pid=peer.pid,
                    uid=peer.uid,
                    gid=peer.gid,
                )
            transport.abort()
            return
        state = {**self._kwargs.get("app_state", {}), PEER_KEY: peer}
        self._inner = H11Protocol(**{**self._kwargs, "app_state": state})
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> None:
        if self._inner is not None:
            self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
