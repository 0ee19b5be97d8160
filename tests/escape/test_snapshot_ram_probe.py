"""``host.snapshot_ram_private`` on real QEMU: restored microVMs share the snapshot's RAM,
and what one guest writes never reaches it; the control (RAM mapped shared from a
writable copy) makes the probe fire.

Every sandbox is made through a :class:`~sandbox_leaks.SandboxTracker`: nothing of it
may survive its end.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend, QemuSandbox
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.escape._vmram import SharedRamControl, shared_ram, snapshot_ram_outcome
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

RES = Resources(memory="1GiB", cpus=1)


@pytest.fixture(scope="module")
def root() -> tuple:  # type: ignore[type-arg]
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    return (info.rootfs, info.hash)


def test_a_restored_guests_writes_stay_its_own(
    root: tuple,  # type: ignore[type-arg]
    tmp_path_factory: pytest.TempPathFactory,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    settings = Settings(data_dir=tmp_path_factory.mktemp("ram-probe"))
    backend = QemuBackend(settings, rootfs=root)
    tracker = sandbox_factory(backend, settings)
    spec = SandboxSpec(name="ram-a", image="default", resources=RES, isolation="strict")
    with tracker.create(spec) as a, tracker.create(spec.replace(name="ram-b")) as b:
        assert isinstance(a, QemuSandbox) and isinstance(b, QemuSandbox)
        assert a.restored and b.restored
        assert shared_ram(a) == shared_ram(b)  # both map the one sealed memfd
        outcome = snapshot_ram_outcome(a)
        assert outcome.status == "pass", outcome.seen
        res = b.exec(["sh", "-c", "cat /dev/shm/ram-probe 2>&1; echo alive"])
        assert res.stdout.decode().endswith("alive\n") and b"agentbox-ram-" not in res.stdout


def test_the_control_fires(
    root: tuple,  # type: ignore[type-arg]
    tmp_path_factory: pytest.TempPathFactory,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    settings = Settings(data_dir=tmp_path_factory.mktemp("ram-control"))
    control = SharedRamControl(settings, rootfs=root)
    spec = SandboxSpec(name="ram-weak", image="default", resources=RES, isolation="strict")
    with sandbox_factory(control, settings).create(spec) as sb:
        assert isinstance(sb, QemuSandbox) and sb.vm.cfg.ram_file is not None
        outcome = snapshot_ram_outcome(sb)
        assert outcome.fired and "marker is in the RAM" in outcome.seen, outcome
