"""The escape suite on the docker backend: runc and runsc (gVisor), with the controls.

One ``agentbox escape-test --backend docker --json --controls -r runc -r runsc``
run (the real CLI, real sandboxes) is shared by every test here; each test then
asserts one property of its JSON. It found, and now guards: the Engine's
``docker-init`` bind (an undeclared mount), the user-namespace counters left
uncapped (no OCI hooks in the Engine) and, under runsc, commands started by
``docker exec`` running without the seccomp filter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from agentbox.escape import PROBES

pytestmark = [pytest.mark.docker, pytest.mark.podman, pytest.mark.slow]

RUNTIMES = ("runc", "runsc")


@pytest.fixture(scope="session")
def suite_json() -> dict[str, Any]:
    args = [sys.executable, "-m", "agentbox", "escape-test", "--backend", "docker", "--json",
            "--controls"]  # fmt: skip
    for rt in RUNTIMES:
        args += ["--runtime", rt]
    res = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    data = json.loads(res.stdout)
    assert isinstance(data, dict)
    return data


def _run(data: dict[str, Any], runtime: str) -> dict[str, Any]:
    runs = [r for r in data["runs"] if r["runtime"] == runtime]
    assert len(runs) == 1
    assert runs[0]["backend"] == "docker"
    run: dict[str, Any] = runs[0]
    return run


def test_every_probe_ran(suite_json: dict[str, Any]) -> None:
    for rt in RUNTIMES:
        ids = [p["id"] for p in _run(suite_json, rt)["probes"]]
        assert set(ids) == {p.id for p in PROBES} and len(ids) == len(set(ids))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_probe_passes(suite_json: dict[str, Any], runtime: str) -> None:
    run = _run(suite_json, runtime)
    failed = [(p["id"], p["seen"]) for p in run["probes"] if p["status"] in ("fail", "error")]
    assert not failed, f"docker {runtime}: confinement probes failed: {failed}"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_not_applicable_is_said_and_explained(suite_json: dict[str, Any], runtime: str) -> None:
    na = [p for p in _run(suite_json, runtime)["probes"] if p["status"] == "n/a"]
    assert all(p["seen"] for p in na)
    # 12, plus what gVisor under docker cannot have by design: the host-side mount flags of
    # /dev and the cgroup hierarchies (its Sentry serves them) and a uid range of its own
    # (every docker gVisor gofer is the daemon's one remapped root): each said, with why.
    assert len(na) <= 15, [p["id"] for p in na]


def test_every_control_fires(suite_json: dict[str, Any]) -> None:
    controls = _run(suite_json, "runc")["controls"]
    assert {c["id"] for c in controls} == {p.id for p in PROBES}
    quiet = [(c["id"], c["seen"]) for c in controls if c["status"] not in ("pass", "n/a")]
    assert not quiet, f"controls that did not fire: {quiet}"
