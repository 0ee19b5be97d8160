"""The sandbox's seccomp profile: podman's default, minus user-namespace creation.

podman's default profile allows ``unshare``/``clone`` with any flags, so a
workload can make a new user namespace and, inside it, mount a cgroup
hierarchy or reach kernel code paths that need CAP_SYS_ADMIN in *some*
namespace — the most common route of recent container-escape CVEs. Agents need
none of that. We derive our profile from the host's default (so it keeps up
with the installed podman) and:

* allow ``clone``/``unshare`` only when ``CLONE_NEWUSER`` is not among the flags;
* answer ``clone3`` with ENOSYS: its flags live in a struct seccomp cannot read,
  and libc falls back to ``clone`` on ENOSYS.

Under gVisor (runsc) ``clone3`` stays allowed: its Sentry does not take glibc's
fallback path (threads fail to start with ENOSYS), and a user namespace made there
is the Sentry's own, never the host kernel's. ``unshare`` is still guarded.

Sockets: an allow-list of address families. podman's default
profile allows ``socket`` for every family, and several reach past the network
namespace: ``AF_VSOCK`` is not scoped by it at all, so on a host that is itself a VM
(this one is: ``/dev/vsock``) the hypervisor is one ``connect`` away; others are
large, rarely used kernel code (``AF_KEY``, ``AF_ALG``, ``AF_RDS``, ``AF_TIPC``,
``AF_CAN``, ``AF_BLUETOOTH``, ``AF_XDP``, …) with a history of privilege-escalation
bugs reachable from an unprivileged socket. An agent (git, python, node, Claude Code)
needs only:

* ``AF_UNIX`` (the gateway socket, local IPC; also the only ``socketpair`` family);
* ``AF_INET`` and ``AF_INET6`` (loopback: the relay on 127.0.0.1, test servers);
* ``AF_NETLINK`` with protocol ``NETLINK_ROUTE`` only (glibc's ``getaddrinfo``
  with ``AI_ADDRCONFIG`` and node's ``os.networkInterfaces`` read interfaces with it).

Every other family, and ``AF_NETLINK`` with any other protocol (audit, generic
netlink, netfilter, xfrm, crypto, uevents, the process connector …), is answered
``EAFNOSUPPORT``, which programs already treat as "not built into this kernel".
The rules are ALLOWs on *exact* 64-bit values: the kernel truncates ``family`` to an
int, so a deny rule on ``40`` would miss ``0x1_0000_0028``; a value with high bits
set matches no ALLOW and falls to a refusal. ``socketcall`` (the 32-bit x86
multiplexer, whose arguments sit in memory seccomp cannot read) is removed and
answers ENOSYS like any syscall the profile does not list. ``io_uring`` (whose
``IORING_OP_SOCKET`` would bypass the ``socket`` filter) is already absent from
podman's default profile, and stays absent. gVisor (runsc) applies the same
profile to the workload inside its Sentry (``--runtime-flag oci-seccomp``).

Native AIO (``io_setup`` …) and ``keyctl`` are removed too (ENOSYS): see
:data:`REFUSED` and docs/explanation/threat-model.md (per-user and host-wide
kernel counters).

The profile is written once per content hash under the cache dir.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from agentbox.errors import UnsupportedError

DEFAULT_PROFILE = Path("/usr/share/containers/seccomp.json")
CLONE_NEWUSER = 0x10000000
_ENOSYS = 38
_EPERM = 1
_EAFNOSUPPORT = 97
_GUARDED = ("clone", "clone3", "unshare", "socket", "socketpair", "socketcall")
#: Removed outright (ENOSYS, the profile's default). Native AIO: ``io_setup`` reserves
#: events from ``fs.aio-max-nr``, ONE host-wide counter (65536): a sandbox took all of
#: it and root's ``io_setup`` got EAGAIN (measured). ``keyctl``: new session keyrings
#: count against the key quota of the sandbox uid that every sandbox shares
#: (``kernel.keys.maxkeys``); add_key/request_key are already absent.
REFUSED = (
    "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy",
    "keyctl",
)  # fmt: skip
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
#: The address families ``socket`` accepts (AF_NETLINK only with NETLINK_ROUTE).
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)


def _arg(index: int, op: str, value: int, value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def _eq(value: int, index: int = 0) -> dict[str, Any]:
    return _arg(index, "SCMP_CMP_EQ", value)


def _in_block(low: int, size: int) -> dict[str, Any]:
    """``low <= family < low + size`` (``size`` a power of two, ``low`` aligned to it)."""
    return _arg(0, "SCMP_CMP_MASKED_EQ", 0xFFFFFFFF & ~(size - 1), low)


def _socket_rules() -> list[dict[str, Any]]:
    """ALLOW the families in :data:`ALLOWED_FAMILIES`; EAFNOSUPPORT for every other value.

    The refusals cover every value no ALLOW matches (each block of families below 17,
    and one ``>= 17`` rule for the rest, negative ints and high-bit tricks included),
    so none falls through to the profile's default (ENOSYS, which reads as "no
    sockets at all"). The refusal masks are 32-bit: a value they match that also has
    high bits set is refused either way, and no ALLOW (exact 64-bit values) overlaps.
    Blocks, not one rule per family, keep the BPF program small on all three x86 ABIs.
    """

    def allow(name: str, *args: dict[str, Any]) -> dict[str, Any]:
        return {"names": [name], "action": "SCMP_ACT_ALLOW", "args": list(args)}

    def refuse(name: str, *args: dict[str, Any]) -> dict[str, Any]:
        return {
            "names": [name],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": _EAFNOSUPPORT,
            "args": list(args),
        }

    ne_route = _arg(2, "SCMP_CMP_NE", NETLINK_ROUTE)
    return [
        allow("socket", _eq(AF_UNIX)),
        allow("socket", _eq(AF_INET)),
        allow("socket", _eq(AF_INET6)),
        allow("socket", _eq(AF_NETLINK), _eq(NETLINK_ROUTE, index=2)),
        refuse("socket", _eq(AF_NETLINK), ne_route),
        # 0, 3, 4-7, 8-9, 11, 12-15 and >= 17: everything but 1, 2, 10 and 16.
        refuse("socket", _eq(0)),
        refuse("socket", _eq(3)),
        refuse("socket", _in_block(4, 4)),
        refuse("socket", _in_block(8, 2)),
        refuse("socket", _eq(11)),
        refuse("socket", _in_block(12, 4)),
        refuse("socket", _arg(0, "SCMP_CMP_GE", AF_NETLINK + 1)),
        # socketpair: AF_UNIX only (0, 2-3, 4-7, 8-15 and >= 16 refused).
        allow("socketpair", _eq(AF_UNIX)),
        refuse("socketpair", _eq(0)),
        refuse("socketpair", _in_block(2, 2)),
        refuse("socketpair", _in_block(4, 4)),
        refuse("socketpair", _in_block(8, 8)),
        refuse("socketpair", _arg(0, "SCMP_CMP_GE", 16)),
    ]


def _derive(base: dict[str, Any], *, allow_clone3: bool = False) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    for rule in base.get("syscalls", []):
        kept = [n for n in rule.get("names", []) if n not in _GUARDED and n not in REFUSED]
        if kept:
            rules.append({**rule, "names": kept})
    flag_ok = {"index": 0, "value": CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    flag_bad = {
        "index": 0,
        "value": CLONE_NEWUSER,
        "valueTwo": CLONE_NEWUSER,
        "op": "SCMP_CMP_MASKED_EQ",
    }
    rules += [
        {"names": ["clone", "unshare"], "action": "SCMP_ACT_ALLOW", "args": [flag_ok]},
        {
            "names": ["clone", "unshare"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": _EPERM,
            "args": [flag_bad],
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ALLOW"}
        if allow_clone3
        else {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
    ]
    rules += _socket_rules()
    # Native ABI only: no compat sub-architecture (i386, x32, arm32 …) in the filter, so a
    # compat syscall matches no architecture and is refused whole. See the module doc.
    arch_map = [{**a, "subArchitectures": []} for a in base.get("archMap", [])]
    return {**base, "archMap": arch_map, "syscalls": rules}


def profile_path(
    cache_dir: Path, base: Path = DEFAULT_PROFILE, *, allow_clone3: bool = False
) -> Path:
    """Write (once) and return the hardened profile derived from ``base``."""
    try:
        raw = base.read_bytes()
        profile = _derive(json.loads(raw), allow_clone3=allow_clone3)
    except (OSError, ValueError) as exc:
        raise UnsupportedError(
            f"cannot read podman's default seccomp profile {base}: {exc}",
            fix="apt-get install golang-github-containers-common",
        ) from exc
    data = json.dumps(profile, indent=1, sort_keys=True).encode()
    digest = hashlib.sha256(data).hexdigest()[:16]
    out = cache_dir / "seccomp" / f"agentbox-{digest}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o644)
        tmp.replace(out)
    return out
