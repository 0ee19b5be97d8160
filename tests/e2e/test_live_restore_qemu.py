"""Live restore of qemu microVM tasks: random launcher kills (see test_live_restore.py),
fewer of them (TCG boots and runs a VM slowly)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from agentbox.backends.base import Backend
from agentbox.config import Settings
from live_restore_helpers import (
    QEMU_WAYS,
    World,
    _chaos,
    _seed,
    world_of,
)
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]


@pytest.fixture
def world(sandbox_factory: Callable[[Backend, Settings], SandboxTracker]) -> Iterator[World]:
    with world_of(sandbox_factory) as w:
        yield w


@pytest.mark.qemu
def test_random_launcher_kills_on_qemu_lose_no_task(world: World) -> None:
    """The chaos test on qemu, with fewer kills (TCG boots and runs a VM slowly)."""
    _chaos(world, tasks=1, phases=QEMU_WAYS, runtime="runc", seed=_seed(), backend="qemu")
