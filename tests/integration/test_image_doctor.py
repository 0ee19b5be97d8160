"""``agentbox doctor`` on this host: podman and runc usable, crun refused for the cgroups reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentbox.cli._doctor import checks
from agentbox.config import Settings
from agentbox.core import host as _host

pytestmark = pytest.mark.podman

AGENTBOX = str(Path(sys.executable).parent / "agentbox")


def _doctor(**env: str) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(
        [AGENTBOX, "doctor", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    return res.returncode, json.loads(res.stdout)


def test_doctor_reports_this_host() -> None:
    rc, report = _doctor()
    rows = {r["name"]: r for r in report["checks"]}
    assert rc == 0 and report["ok"] is True
    assert rows["podman"]["ok"] and rows["podman"]["essential"]
    assert rows["runtime runc"]["ok"] and rows["runtime runc"]["essential"]
    assert rows["mmdebstrap"]["ok"] and rows["apt sources"]["ok"]
    for name in ("cgroups", "user namespaces", "kvm", "qemu", "bubblewrap", "claude", "image"):
        assert name in rows, name
    crun = rows["runtime crun"]
    if _host.cgroup_mode() != "v2" and crun["status"] != "missing":
        assert crun["status"] == "refused" and not crun["ok"]
        assert "cgroups" in crun["detail"] and "unified_cgroup_hierarchy" in crun["fix"]
    for r in report["checks"]:
        assert r["ok"] or r["fix"], f"{r['name']} is missing without a fix"


def test_doctor_says_how_to_fix_missing_pieces() -> None:
    rc, report = _doctor(
        AGENTBOX_CLAUDE_CODE_VERSION="0.0.0-missing", AGENTBOX_IMAGE="localhost/agentbox-nope:x"
    )
    rows = {r["name"]: r for r in report["checks"]}
    # Neither is essential: the report still passes, and says what to do.
    assert rc == 0
    assert rows["claude"]["status"] == "missing" and "setup.sh" in rows["claude"]["fix"]
    assert rows["image"]["status"] == "missing" and rows["image"]["fix"] == "agentbox image build"


def test_checks_api_and_table() -> None:
    rows = checks(Settings())
    assert [r.facility.name for r in rows][:4] == [
        "podman",
        "runtime runc",
        "runtime crun",
        "runtime runsc",
    ]
    assert {r.facility.name for r in rows if r.essential} == {
        "podman", "runtime runc", "mmdebstrap", "apt sources"
    }  # fmt: skip
    res = subprocess.run(
        [AGENTBOX, "doctor"], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0 and "essentials present" in res.stdout
