"""The derived seccomp profile: podman's default, minus user-namespace creation."""

from __future__ import annotations

import json
from pathlib import Path

from agentbox.backends._seccomp import CLONE_NEWUSER, DEFAULT_PROFILE, _derive, profile_path


def _base() -> dict[str, object]:
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [
            {"names": ["read", "clone", "clone3", "unshare", "write"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["setns"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
        ],
    }


def test_guarded_calls_lose_their_blanket_allow() -> None:
    prof = _derive(_base())
    blanket = [r for r in prof["syscalls"] if not r.get("args")]
    names = {n for r in blanket if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    assert {"read", "write"} <= names
    assert not names & {"clone", "clone3", "unshare"}


def test_clone_allowed_only_without_newuser() -> None:
    prof = _derive(_base())
    conditional = [r for r in prof["syscalls"] if r.get("args")]
    allow = next(r for r in conditional if r["action"] == "SCMP_ACT_ALLOW")
    deny = next(r for r in conditional if r["action"] == "SCMP_ACT_ERRNO")
    assert allow["args"][0] == {
        "index": 0, "value": CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"
    }  # fmt: skip
    assert deny["args"][0]["valueTwo"] == CLONE_NEWUSER
    clone3 = next(r for r in prof["syscalls"] if r["names"] == ["clone3"])
    assert clone3["action"] == "SCMP_ACT_ERRNO" and clone3["errnoRet"] == 38


def test_profile_written_once_and_valid_json(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_base()))
    p1 = profile_path(tmp_path / "cache", base)
    p2 = profile_path(tmp_path / "cache", base)
    assert p1 == p2
    assert json.loads(p1.read_text())["defaultAction"] == "SCMP_ACT_ERRNO"


def test_host_default_profile_derives() -> None:
    if not DEFAULT_PROFILE.exists():
        import pytest

        pytest.skip(f"{DEFAULT_PROFILE} not installed (podman's containers-common)")
    prof = _derive(json.loads(DEFAULT_PROFILE.read_text()))
    allowed = {
        n for r in prof["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")
        for n in r["names"]
    }  # fmt: skip
    assert "unshare" not in allowed and "read" in allowed


def test_runsc_variant_keeps_clone3_but_guards_unshare() -> None:
    prof = _derive(_base(), allow_clone3=True)
    clone3 = next(r for r in prof["syscalls"] if r["names"] == ["clone3"])
    assert clone3["action"] == "SCMP_ACT_ALLOW"
    assert any(r.get("args") and "unshare" in r["names"] for r in prof["syscalls"])


# -- address families (issue 11, item 7) -------------------------------------------------

AF_VSOCK = 40


def _matches(arg: dict[str, int | str], value: int) -> bool:
    op, v, v2 = arg["op"], int(arg["value"]), int(arg["valueTwo"])
    if op == "SCMP_CMP_EQ":
        return value == v
    if op == "SCMP_CMP_NE":
        return value != v
    if op == "SCMP_CMP_GE":
        return value >= v
    if op == "SCMP_CMP_MASKED_EQ":
        return value & v == v2
    raise AssertionError(f"unexpected op {op}")


def _verdict(prof: dict[str, object], name: str, family: int, protocol: int = 0) -> str:
    """What the profile's rules answer for ``name(family, type, protocol)`` (as libseccomp:
    the rules' conditions are ANDed; none matching means the default action)."""
    hits = set()
    for rule in prof["syscalls"]:  # type: ignore[attr-defined]
        if name not in rule["names"]:
            continue
        args = {0: family, 2: protocol}
        if all(_matches(a, args[a["index"]]) for a in rule.get("args") or []):
            hits.add(rule["action"] + str(rule.get("errnoRet", "")))
    assert len(hits) <= 1, f"{name}({family}, proto {protocol}) matches conflicting {hits}"
    return hits.pop() if hits else "default"


def test_socket_allows_only_the_families_agents_need() -> None:
    prof = _derive(_base())
    allowed = {f for f in range(64) if _verdict(prof, "socket", f) == "SCMP_ACT_ALLOW"}
    assert allowed == {1, 2, 10, 16}
    # Netlink only for NETLINK_ROUTE; audit, uevent, generic, sock_diag refused.
    for proto in (4, 9, 15, 16):
        assert _verdict(prof, "socket", 16, proto) == "SCMP_ACT_ERRNO97"
    assert _verdict(prof, "socket", 16, 0) == "SCMP_ACT_ALLOW"


def test_every_other_family_is_eafnosupport_not_a_fall_through() -> None:
    prof = _derive(_base())
    for fam in [*range(64), 255, 1 << 31, AF_VSOCK | 1 << 32, 2 | 1 << 32, (1 << 64) - 1]:
        if fam in (1, 2, 10, 16):
            continue
        assert _verdict(prof, "socket", fam) == "SCMP_ACT_ERRNO97", fam


def test_high_bits_do_not_sneak_vsock_past_the_filter() -> None:
    # The kernel truncates the family to an int: 0x1_0000_0028 is AF_VSOCK to it.
    prof = _derive(_base())
    assert _verdict(prof, "socket", AF_VSOCK | 1 << 32) != "SCMP_ACT_ALLOW"
    assert _verdict(prof, "socket", 1 | 1 << 32) != "SCMP_ACT_ALLOW"


def test_socketpair_is_unix_only_and_socketcall_is_gone() -> None:
    base = _base()
    base["syscalls"].append(  # type: ignore[attr-defined]
        {"names": ["socket", "socketpair", "socketcall"], "action": "SCMP_ACT_ALLOW"}
    )
    prof = _derive(base)
    assert _verdict(prof, "socketpair", 1) == "SCMP_ACT_ALLOW"
    for fam in (0, 2, 10, 16, AF_VSOCK, 63, 1 << 40):
        assert _verdict(prof, "socketpair", fam) == "SCMP_ACT_ERRNO97", fam
    names = {n for r in prof["syscalls"] for n in r["names"]}
    assert "socketcall" not in names
    # The base's blanket socket ALLOW is gone: only our conditional rules name socket.
    assert all(r.get("args") for r in prof["syscalls"] if "socket" in r["names"])


def test_compat_abis_are_dropped_from_the_arch_map() -> None:
    base = _base()
    base["archMap"] = [
        {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}
    ]
    prof = _derive(base)
    # i386's socketcall multiplexes socket(): libseccomp cannot filter its arguments
    # (and refuses mixed actions on it), so the compat ABIs are not admitted at all.
    assert prof["archMap"] == [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": []}]


def test_host_default_profile_keeps_io_uring_out() -> None:
    if not DEFAULT_PROFILE.exists():
        import pytest

        pytest.skip(f"{DEFAULT_PROFILE} not installed (podman's containers-common)")
    prof = _derive(json.loads(DEFAULT_PROFILE.read_text()))
    allowed = {n for r in prof["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    # IORING_OP_SOCKET would make sockets without the socket() syscall.
    assert not allowed & {"io_uring_setup", "io_uring_enter", "io_uring_register", "socketcall"}
    assert _verdict(prof, "socket", AF_VSOCK) == "SCMP_ACT_ERRNO97"


def test_native_aio_and_keyctl_are_removed() -> None:
    base = _base()
    base["syscalls"].append(  # type: ignore[attr-defined]
        {"names": ["io_setup", "io_submit", "keyctl", "getpid"], "action": "SCMP_ACT_ALLOW"}
    )
    prof = _derive(base)
    names = {n for r in prof["syscalls"] for n in r["names"]}
    # io_setup draws on fs.aio-max-nr, one host-wide counter; keyctl on the shared uid's
    # key quota. Not listed means the profile's default: ENOSYS.
    assert not names & {"io_setup", "io_submit", "keyctl"}
    assert "getpid" in names
