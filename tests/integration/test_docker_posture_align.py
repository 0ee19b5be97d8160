"""The docker backend's sandbox is no looser than podman's (issue 33 §7): the cgroup
hierarchies read-only (a userns-remapped daemon mounts the v1 ones rw) and
``/sys/dev/block`` masked. On the old HostConfig both assertions fail."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import get_backend
from agentbox.backends.base import SandboxSpec
from agentbox.backends.docker import DockerBackend
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.docker

_SCRIPT = r"""
import os
top = {}
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    f, r = left.split(), right.split()
    top[f[4]] = (r[0], f[5].split(","))
cg = sorted(t for t, (fs, o) in top.items() if fs in ("cgroup", "cgroup2") and "ro" not in o)
print("rw-cgroups", ",".join(cg) or "-")
print("dev-block", len(os.listdir("/sys/dev/block")))
"""


@pytest.fixture
def backend(
    settings_factory: Callable[[], Settings], default_image: str
) -> Iterator[DockerBackend]:
    be = get_backend("docker", settings_factory())
    assert isinstance(be, DockerBackend)
    yield be
    be.client.close()


def test_cgroups_read_only_and_block_devices_masked(
    backend: DockerBackend,
    sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker],
    workspace_factory: Callable[[Settings], Path],
) -> None:
    boxes = sandbox_factory(backend, backend.settings)
    spec = SandboxSpec(name=f"d1-align-{os.getpid()}", image=backend.settings.image,
                       workspace=workspace_factory(backend.settings))  # fmt: skip
    with boxes.create(spec) as box:
        hc = box.inspect()["HostConfig"]
        assert "/sys/dev/block" in hc["MaskedPaths"] and "/proc/kcore" in hc["MaskedPaths"]
        assert "/proc/sys" in hc["ReadonlyPaths"]
        out = box.exec(["python3", "-I", "-S", "-c", _SCRIPT]).stdout.decode().split()
    assert out == ["rw-cgroups", "-", "dev-block", "0"], out
