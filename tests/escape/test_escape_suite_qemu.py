"""The escape suite on the qemu microVM backend, strict isolation (the one for agents).

Shared-kernel probes are n/a there (they would read the guest's own kernel);
the VMM's own confinement is read from the host. Skips with the probed reason
only where QEMU is missing; under ``AGENTBOX_REQUIRE=qemu`` that is an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from agentbox.escape import PROBES

pytestmark = [pytest.mark.qemu, pytest.mark.slow]


@pytest.fixture(scope="module")
def qemu_run() -> dict[str, Any]:
    args = [sys.executable, "-m", "agentbox", "escape-test", "--json", "--controls"]
    args += ["--backend", "qemu", "--isolation", "strict"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    data = json.loads(res.stdout)
    run: dict[str, Any] = data["runs"][0]
    assert run["backend"] == "qemu"
    return run


def test_qemu_strict_passes_every_probe(qemu_run: dict[str, Any]) -> None:
    failed = [(p["id"], p["seen"]) for p in qemu_run["probes"] if p["status"] in ("fail", "error")]
    assert not failed
    assert {p["id"] for p in qemu_run["probes"]} == {p.id for p in PROBES}


def test_qemu_vmm_posture_is_checked_not_skipped(qemu_run: dict[str, Any]) -> None:
    status = {p["id"]: p["status"] for p in qemu_run["probes"]}
    for pid in (
        "host.caps_effective", "host.no_new_privs", "host.seccomp", "host.uid",
        "host.ns_net", "host.pids_limit", "host.memory_limit", "host.own_kernel",
        "host.forkbomb_contained", "host.forkbomb_latency",
    ):  # fmt: skip
        assert status[pid] == "pass", pid
    # Guest-kernel probes are n/a, and say why.
    na = [p for p in qemu_run["probes"] if p["status"] == "n/a"]
    assert all(p["seen"] for p in na)


def test_controls_fire_alongside_a_microvm_run(qemu_run: dict[str, Any]) -> None:
    quiet = [
        (c["id"], c["status"], c.get("seen"))
        for c in qemu_run["controls"]
        if c["status"] not in ("pass", "n/a")
    ]
    assert not quiet  # with what each control saw: a timing failure is told from a real one
    assert sum(c["status"] == "pass" for c in qemu_run["controls"]) >= 40
