"""The launcher's peer check on real unix sockets (no privileges needed)."""

from __future__ import annotations

import os
import socket

from agentbox.launcher._peer import may_connect
from agentbox.linux.peer import Peer, peer_of


def test_peer_of_reads_the_kernels_record_of_the_other_end() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_of(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(peer.groups) == set(os.getgroups())


def test_who_may_connect() -> None:
    me = os.geteuid()
    stranger = 64999 if me != 64999 else 64998
    assert may_connect(Peer(1, 0, 0, ()), None)  # root
    assert may_connect(Peer(1, me, me, ()), None)  # the launcher's own uid
    assert not may_connect(Peer(1, stranger, stranger, ()), None)  # no group: nobody else
    assert not may_connect(Peer(1, stranger, stranger, (5, 6)), 995)
    assert may_connect(Peer(1, stranger, stranger, (5, 995)), 995)  # supplementary group
    assert may_connect(Peer(1, stranger, 995, ()), 995)  # primary group
