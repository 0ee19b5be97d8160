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
