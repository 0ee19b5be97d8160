"""The firecracker backend: skips with the reason where there is no binary or no KVM."""

from __future__ import annotations

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.firecracker import FirecrackerBackend, firecracker_binaries
from agentbox.config import Settings
from agentbox.errors import UnsupportedError


def test_refuses_without_a_binary_naming_the_fix() -> None:
    backend = FirecrackerBackend(Settings(firecracker_binary=None))
    with pytest.raises(UnsupportedError, match="AGENTBOX_FIRECRACKER_BINARY"):
        backend.check(SandboxSpec(name="fc", image="default"))


@pytest.mark.firecracker
def test_firecracker_where_installed() -> None:
    settings = Settings()
    try:
        firecracker_binaries(settings)
    except UnsupportedError as exc:
        pytest.skip(f"firecracker: {exc}")
    with pytest.raises(UnsupportedError):
        FirecrackerBackend(settings).check(SandboxSpec(name="fc", image="default"))
