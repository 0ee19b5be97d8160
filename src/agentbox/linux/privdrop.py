"""Drop root for good: the one privilege drop of every process that parses untrusted input.

The gateway, the egress proxy and the MCP server read what a sandboxed (and perhaps
prompt-injected) model wrote; each becomes an ordinary uid with nothing left before it
reads a byte. :func:`drop_to`:

1. (as root) hands ``own`` paths to the new identity, empties the capability bounding set
   (``PR_CAPBSET_DROP`` needs ``CAP_SETPCAP``, so it comes first) and the ambient set;
2. (as root) sets exactly ``groups`` as the supplementary groups, then ``setresgid`` and
   ``setresuid``, which clears the permitted and effective sets;
3. writes all-zero capability sets with ``capset`` and sets ``PR_SET_NO_NEW_PRIVS``, so no
   setuid binary or file capability can give any of it back;
4. reads ``/proc/self/status`` back: a process that still holds a capability, a root uid or
   not the identity asked for raises :class:`PrivilegeDropError` and goes no further.

Started as an ordinary user, it must already be ``uid``/``gid``: steps 3 and 4 apply.
The bounding set, capset and no_new_privs are per thread: call it while the process has one.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

from agentbox.errors import PrivilegeDropError
from agentbox.linux.libc import libc

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_POSTURE = {"Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"}


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def process_posture(pid: int | str = "self") -> dict[str, str]:
    """The privilege-relevant lines of ``/proc/<pid>/status`` (Uid, Cap*, NoNewPrivs…)."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _POSTURE:
            out[key] = value.strip()
    return out


def _prctl(lib: ctypes.CDLL, option: int, arg: int, arg3: int = 0) -> None:
    if lib.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg3), 0, 0) != 0:
        err = ctypes.get_errno()
        raise PrivilegeDropError(f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def _empty_bounding_set(lib: ctypes.CDLL) -> None:
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _prctl(lib, _PR_CAPBSET_DROP, cap)
    _prctl(lib, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


def drop_to(uid: int, gid: int, groups: Iterable[int] = (), *, own: Iterable[Path] = ()) -> None:
    """Become ``uid``/``gid`` with exactly ``groups``, no capability and no_new_privs; verify.

    Raises :class:`PrivilegeDropError` when the drop is refused or did not take.
    """
    lib = libc()
    was_root = os.geteuid() == 0
    if was_root:
        for path in own:
            os.chown(path, uid, gid)
        _empty_bounding_set(lib)
        os.setgroups(list(groups))
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    elif (os.getuid(), os.getgid()) != (uid, gid):
        raise PrivilegeDropError(
            f"cannot become {uid}:{gid} from uid {os.getuid()}: only a process started as "
            "root drops to another identity"
        )
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if lib.capset(ctypes.byref(hdr), ctypes.byref(data)) != 0:
        err = ctypes.get_errno()
        raise PrivilegeDropError(f"capset to empty sets failed: {os.strerror(err)}")
    _prctl(lib, _PR_SET_NO_NEW_PRIVS, 1)
    st = process_posture()
    # The bounding set can only be emptied by a process that started as root (CAP_SETPCAP).
    sets = ["CapInh", "CapPrm", "CapEff", "CapAmb"] + (["CapBnd"] if was_root else [])
    held = {k: st.get(k) for k in sets if int(st.get(k, "0"), 16)}
    uids = st.get("Uid", "").split()
    if held or st.get("NoNewPrivs") != "1" or "0" in uids:
        raise PrivilegeDropError(f"privilege drop did not take: {held or st}")
    if os.geteuid() != uid or os.getuid() != uid or os.getgid() != gid:
        raise PrivilegeDropError(f"could not drop privileges to {uid}:{gid}")
