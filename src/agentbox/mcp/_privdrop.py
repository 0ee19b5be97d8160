"""Drop root for good: the MCP server runs as an ordinary uid with no capabilities.

The MCP server parses requests written by a model that may be prompt-injected,
so if it is started as root (``agentbox serve``, or a root-owned Claude Code
spawning ``agentbox mcp``) it gives every privilege away before it reads a
single request:

1. every capability is removed from the bounding set (``PR_CAPBSET_DROP``; needs
   ``CAP_SETPCAP``, so this comes first) and the ambient set is cleared;
2. supplementary groups are replaced (only the launcher socket's group, if it
   has a dedicated one), then ``setresgid`` and ``setresuid`` to the target,
   which clears the permitted and effective sets;
3. ``capset`` writes all-zero sets explicitly, and ``PR_SET_NO_NEW_PRIVS``
   makes sure no setuid binary or file capability can give any of it back;
4. ``/proc/self/status`` is read back and the drop verified; a process that
   still holds anything refuses to go on.

Started as an ordinary user, only step 3's no-new-privs applies.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import PolicyRefused, PrivilegeDropError
from agentbox.linux.libc import libc

__all__ = ["Identity", "drop_privileges", "process_posture", "resolve_identity"]

log = get_logger(__name__)

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Identity:
    """Who the MCP server runs as after the drop."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def load_libc() -> ctypes.CDLL:
    """The C library, with errno kept for :func:`ctypes.get_errno`."""
    return libc()


def _prctl(libc: ctypes.CDLL, option: int, arg: int, arg3: int = 0) -> None:
    if libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg3), 0, 0) != 0:
        err = ctypes.get_errno()
        raise PrivilegeDropError(f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def resolve_identity(user: str | None, repos_root: Path, socket_path: Path | None) -> Identity:
    """The uid/gid to drop to: ``user`` (a name or a number) or the repos root's owner.

    The launcher socket's group is kept as the only supplementary group when it
    is a dedicated group (not gid 0), so the server can still connect to it.
    Refuses uid 0: the point is to not be root.
    """
    if user:
        try:
            pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
            uid, gid = pw.pw_uid, pw.pw_gid
        except KeyError:
            if not user.isdigit():
                raise PolicyRefused(f"no such user for the MCP server: {user!r}") from None
            uid = gid = int(user)  # a bare uid without a passwd entry is fine
    else:
        st = repos_root.stat()
        uid, gid = st.st_uid, st.st_gid
    if uid == 0:
        raise PolicyRefused(
            f"the MCP server will not run as root, and the repos root {repos_root} is owned by "
            "root: pass --user NAME (the owner of the repos to delegate) or set "
            "AGENTBOX_MCP_USER, or make the repos root belong to an ordinary user"
        )
    groups: tuple[int, ...] = ()
    if socket_path is not None:
        try:
            sst = socket_path.stat()
        except OSError:
            sst = None
        if sst is not None and stat.S_ISSOCK(sst.st_mode) and sst.st_gid not in (0, gid):
            groups = (sst.st_gid,)
    return Identity(uid=uid, gid=gid, groups=groups)


def process_posture(pid: int | str = "self") -> dict[str, str]:
    """The privilege-relevant lines of ``/proc/<pid>/status`` (Uid, Cap*, NoNewPrivs…)."""
    keep = {"Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"}
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keep:
            out[key] = value.strip()
    return out


def drop_privileges(identity: Identity | None) -> None:
    """Become ``identity`` with no capabilities and no-new-privs, then verify it.

    ``identity`` None (not started as root): only set no-new-privs and check
    that no capability is held. Raises :class:`PrivilegeDropError` if anything
    survives the drop.
    """
    libc = load_libc()
    # The bounding set, capset and no-new-privs are per thread: drop while we are the only one,
    # so every thread started later inherits the dropped state.
    threads = [p.name for p in Path("/proc/self/task").iterdir()]
    if len(threads) != 1:
        raise PrivilegeDropError(f"privilege drop needs a single-threaded process, found {threads}")
    if os.geteuid() == 0:
        if identity is None:
            raise PrivilegeDropError("started as root without an identity to drop to")
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            _prctl(libc, PR_CAPBSET_DROP, cap)
        _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        os.setgroups(list(identity.groups))
        os.setresgid(identity.gid, identity.gid, identity.gid)
        os.setresuid(identity.uid, identity.uid, identity.uid)
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(hdr), ctypes.byref(data)) != 0:
        err = ctypes.get_errno()
        raise PrivilegeDropError(f"capset to empty sets failed: {os.strerror(err)}")
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    st = process_posture()
    # The bounding set can only be emptied when we started as root (it needs CAP_SETPCAP).
    sets = ["CapInh", "CapPrm", "CapEff", "CapAmb"] + (["CapBnd"] if identity else [])
    held = {k: st.get(k) for k in sets if int(st.get(k, "0"), 16)}
    uids = st.get("Uid", "").split()
    if held or st.get("NoNewPrivs") != "1" or "0" in uids:
        raise PrivilegeDropError(f"privilege drop did not take: {held or st}")
    if identity is not None and os.geteuid() != identity.uid:
        raise PrivilegeDropError(f"still uid {os.geteuid()} after dropping to {identity.uid}")
    log.info("privileges dropped", uid=os.geteuid(), gid=os.getegid(), groups=os.getgroups())
