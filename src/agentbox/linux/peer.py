"""Who is at the other end of a unix socket, as the kernel recorded it at ``connect()``.

The one reader of ``SO_PEERCRED`` (with ``SO_PEERGROUPS`` and ``SO_PEERPIDFD``) and the one
:class:`Peer` type: the launcher's socket decides by the caller's uid and groups; the front
end also pins the caller's process with a pidfd, so that what it then reads under
``/proc/<pid>`` cannot belong to another process that took the pid over.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from dataclasses import dataclass

# Linux's SO_PEERGROUPS (4.13+) and SO_PEERPIDFD (6.5); Python 3.11 names neither.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
# CPython's getsockopt() takes at most 1024 bytes: 256 groups. A peer with more is
# refused (ERANGE, raised as OSError), never guessed at.
_GROUPS_BUF = 1024
_CRED = struct.Struct("iII")


@dataclass(frozen=True)
class Peer:
    """The connected process: pid, uid, gid, its supplementary groups when asked for, and
    a pidfd that pins it when asked for (then :meth:`close` it)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    pidfd: int | None = None

    def close(self) -> None:
        """Close the pidfd, if there is one (idempotent in effect: errors are ignored)."""
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)


def peer_of(sock: socket.socket, *, groups: bool = False, pin: bool = False) -> Peer:
    """The peer of the connected unix socket ``sock``.

    ``groups``: also read its supplementary groups (OSError past 256). ``pin``: also take
    a pidfd of it (the socket's own where the kernel gives one, else ``pidfd_open``).
    """
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    grps: tuple[int, ...] = ()
    if groups:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _GROUPS_BUF)
        grps = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    pidfd = None
    if pin:
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError:
            pidfd = os.pidfd_open(pid)  # older kernels: the caller checks it is alive after
    return Peer(pid, uid, gid, grps, pidfd)
