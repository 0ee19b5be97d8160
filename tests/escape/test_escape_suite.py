"""The escape suite on this machine's real runtimes: podman with runc and with runsc (gVisor).

One ``agentbox escape-test --json --controls -r runc -r runsc`` run (the real CLI,
real sandboxes) is shared by every test here; each test then asserts one
property of its JSON. These tests do not skip on a machine with podman: the
conftest turns a missing podman into an error under ``AGENTBOX_REQUIRE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from agentbox.core import host as _host
from agentbox.escape import PROBES

pytestmark = [pytest.mark.podman, pytest.mark.slow]

RUNTIMES = ("runc", "runsc")


@pytest.fixture(scope="session")
def suite_json() -> dict[str, Any]:
    """The parsed output of one CLI run over both runtimes, with the controls."""
    for rt in RUNTIMES:
        fac = _host.podman_runtime(rt)
        assert fac.ok, f"{rt} must be usable on this machine: {fac.detail}"
    args = [sys.executable, "-m", "agentbox", "escape-test", "--json", "--controls"]
    for rt in RUNTIMES:
        args += ["--runtime", rt]
    res = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    data = json.loads(res.stdout)
    assert isinstance(data, dict)
    data["_returncode"] = res.returncode
    return data


def _run(data: dict[str, Any], runtime: str) -> dict[str, Any]:
    runs = [r for r in data["runs"] if r["runtime"] == runtime]
    assert len(runs) == 1
    run: dict[str, Any] = runs[0]
    return run


def test_json_parses_and_has_at_least_40_probes(suite_json: dict[str, Any]) -> None:
    for rt in RUNTIMES:
        run = _run(suite_json, rt)
        ids = [p["id"] for p in run["probes"]]
        assert len(ids) >= 40 and len(ids) == len(set(ids))
        assert set(ids) == {p.id for p in PROBES}
        assert all(p["status"] in ("pass", "fail", "n/a", "error") for p in run["probes"])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_probe_passes(suite_json: dict[str, Any], runtime: str) -> None:
    run = _run(suite_json, runtime)
    failed = [(p["id"], p["seen"]) for p in run["probes"] if p["status"] in ("fail", "error")]
    assert not failed, f"{runtime}: confinement probes failed: {failed}"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_not_applicable_is_said_and_explained(suite_json: dict[str, Any], runtime: str) -> None:
    run = _run(suite_json, runtime)
    na = [p for p in run["probes"] if p["status"] == "n/a"]
    # Only kernels without the file, runtime-specific views, and VM-only checks may be n/a.
    assert all(p["seen"] for p in na)
    assert len(na) <= 12, [p["id"] for p in na]


def test_every_control_fires(suite_json: dict[str, Any]) -> None:
    controls = _run(suite_json, "runc")["controls"]
    assert {c["id"] for c in controls} == {p.id for p in PROBES}
    quiet = [(c["id"], c["seen"]) for c in controls if c["status"] not in ("pass", "n/a")]
    assert not quiet, f"controls that did not fire: {quiet}"
    # n/a only where this kernel lacks the file on the host too.
    na = [c for c in controls if c["status"] == "n/a"]
    assert all("this kernel has none" in c["seen"] for c in na), na
    assert sum(c["status"] == "pass" for c in controls) >= 40


def test_exit_code_reflects_the_verdict(suite_json: dict[str, Any]) -> None:
    assert suite_json["_returncode"] == (0 if suite_json["ok"] else 1)


def test_nothing_is_left_behind(suite_json: dict[str, Any]) -> None:
    res = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    names = res.stdout.split()
    for run in suite_json["runs"]:
        # Only this run's names: other users of the machine may run the suite meanwhile.
        mine = str(run["facts"]["sandbox"])
        assert not [n for n in names if n.startswith(mine)]
        assert not os.path.exists(str(run["facts"]["fixture_root"]))
