"""Who is calling the front end, read from the kernel, never from the request.

A caller is served only when its process holds exactly what the server holds
(:func:`same_rights`): the socket is the server's uid's alone (0600), but a process
of that uid may hold fewer rights (a root shell in a container or a confined unit:
fewer capabilities, a seccomp filter, no-new-privs, other namespaces), and a
command forked by the server must not have more than its caller.

The caller is pinned by a pidfd taken with the connection (``SO_PEERPIDFD``, or
``pidfd_open`` of its ``SO_PEERCRED`` pid): what is read under ``/proc/<pid>`` is
that process's only while the pidfd says it has not exited (:func:`alive`), since a
pid is reused once its process is reaped.
"""

from __future__ import annotations

import os
import resource
import select
import socket
from pathlib import Path
from typing import Any

from agentbox.linux.inherit import LIMITS
from agentbox.linux.peer import Peer, peer_of

#: The lines of /proc/<pid>/status that are a process's rights.
RIGHTS = (
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
)
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")


def pinned_peer(sock: socket.socket) -> Peer:
    """The process that called ``connect()`` on the other end of ``sock``, pinned by a pidfd."""
    return peer_of(sock, pin=True)


def alive(peer: Peer) -> bool:
    """Whether the caller has not exited (so ``/proc/<pid>`` was its own until now)."""
    poller = select.poll()
    assert peer.pidfd is not None, "a pinned peer"
    poller.register(peer.pidfd, select.POLLIN)
    return not poller.poll(0)


def _status(pid: int | str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = " ".join(value.split())
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:  # no LSM, no such namespace: the same answer for both
        return f"<{exc.errno}>"


def _rights(pid: int | str) -> dict[str, str]:
    status = _status(pid)
    out = {k: status.get(k, "") for k in RIGHTS}
    for ns in NAMESPACES:
        try:
            out[f"ns/{ns}"] = str(Path(f"/proc/{pid}/ns/{ns}").readlink())
        except OSError as exc:
            out[f"ns/{ns}"] = f"<{exc.errno}>"
    root = Path(f"/proc/{pid}/root/").stat()
    out["root"] = f"{root.st_dev}:{root.st_ino}"
    out["lsm"] = _read(f"/proc/{pid}/attr/current")
    return out


def own_rights() -> dict[str, str]:
    """This process's rights as :func:`same_rights` compares them (the server reads
    them once, at its start: nothing it runs changes them)."""
    return _rights("self")


def same_rights(peer: Peer, mine: dict[str, str]) -> str | None:
    """None when the caller holds exactly the rights ``mine`` (this process's, from
    :func:`own_rights`), else what differs."""
    if peer.uid != os.getuid() or peer.uid != os.geteuid():
        return f"uid {peer.uid} is not the server's"
    try:
        theirs = _rights(peer.pid)
    except OSError as exc:
        return f"cannot read the caller's process ({exc.strerror})"
    # The mount namespace is joined, not compared (a unit's PrivateTmp=yes puts the
    # server in one of its own): the command sees the caller's mounts
    # (agentbox.front._child._join_mounts); the root directory still must match.
    differ = sorted(k for k in mine if mine[k] != theirs.get(k) and k != "ns/mnt")
    if not alive(peer):
        return "the caller exited"
    if differ:
        return "the caller's " + ", ".join(differ) + " differ from the server's"
    return None


def posture_of(peer: Peer) -> dict[str, Any]:
    """What the command takes on from its caller: cgroups, nice value, CPU affinity,
    OOM score adjustment, resource limits, umask and blocked signals."""
    from agentbox.linux.cgroups import cgroups_of

    status = _status(peer.pid)
    posture = {
        "pid": peer.pid,
        "cgroups": cgroups_of(peer.pid),
        "nice": os.getpriority(os.PRIO_PROCESS, peer.pid),
        "affinity": sorted(os.sched_getaffinity(peer.pid)),
        "oom_score_adj": Path(f"/proc/{peer.pid}/oom_score_adj").read_text().strip(),
        "limits": {int(r): resource.prlimit(peer.pid, r) for r in LIMITS},
        "umask": int(status.get("Umask", "022"), 8),
        "blocked": int(status.get("SigBlk", "0"), 16),
    }
    if not alive(peer):
        raise ProcessLookupError("the caller exited")
    return posture
