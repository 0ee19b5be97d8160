"""``agentbox smoke --backend docker``: the seed's smoke test, literally, under runc and runsc.

``docker inspect`` (NetworkMode none with only lo, ReadonlyRootfs, CapDrop [ALL],
CapAdd [], no-new-privileges, User 64000, exactly the declared mounts), then from
inside (``id -u``, ``/proc/self/status``) and the behavioural probes. The gateway
dir's bind carries ``nosuid,nodev,noexec`` although the Engine's bind API has no
such options (it failed before the hardened bind points of _binds.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agentbox.config import Settings
from agentbox.smoke import run_smoke

pytestmark = pytest.mark.docker

SEED_CHECKS = {
    ("host", "NetworkMode"), ("host", "networks"), ("host", "ReadonlyRootfs"),
    ("host", "CapDrop"), ("host", "CapAdd"), ("host", "no-new-privileges"), ("host", "User"),
    ("host", "mounts (inspect)"), ("inside", "uid"), ("inside", "CapEff"),
    ("inside", "NoNewPrivs"), ("inside", "network interfaces"), ("inside", "mounts"),
    ("inside", "writing to /usr fails"), ("inside", "DNS fails"), ("inside", "HTTPS fails"),
    ("host", "userns-remap"),
}  # fmt: skip


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_smoke_passes_with_every_seed_check(
    settings_factory: Callable[[], Settings], default_image: str, runtime: str
) -> None:
    posture = run_smoke(settings_factory(), backend="docker", runtime=runtime)
    failed = [c for c in posture.checks if not c.ok]
    assert not failed, failed
    seen = {(c.where, c.name) for c in posture.checks}
    assert seen >= SEED_CHECKS, SEED_CHECKS - seen
    assert posture.backend == "docker"
    if runtime == "runc":
        mounts = [c for c in posture.checks if c.name == "data mounts nosuid,nodev"]
        assert mounts and mounts[0].ok
