"""The escape suite's gateway posture checks, on real gateway processes.

The gateway is spawned exactly as a task gets it; the control spawns it the way the
launcher did before issue 11 (root, unconfined), on which every check must fire.
"""

from __future__ import annotations

import os

import pytest

from agentbox.config import Settings
from agentbox.escape._gateway import GATEWAY_CHECKS, gateway_outcomes
from agentbox.escape._registry import PROBES

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the gateway drops from root only")


def test_every_check_is_a_registered_host_probe() -> None:
    ids = {p.id: p for p in PROBES}
    for cid in GATEWAY_CHECKS:
        assert ids[cid].where == "host" and ids[cid].control == "weak"


def test_a_task_gateway_passes_every_check(settings: Settings) -> None:
    got = gateway_outcomes(settings)
    assert [o.id for o in got] == list(GATEWAY_CHECKS)
    assert all(o.status == "pass" for o in got), got


def test_control_unconfined_gateway_fires_every_check(settings: Settings) -> None:
    got = gateway_outcomes(settings, control=True)
    assert [o.id for o in got] == list(GATEWAY_CHECKS)
    assert all(o.fired for o in got), got
