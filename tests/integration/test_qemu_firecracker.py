"""The firecracker backend refuses, naming the fix, where no binary is configured.

The live tests are in test_firecracker_vm.py (marked ``firecracker``).
"""

from __future__ import annotations

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm.firecracker import FirecrackerBackend
from agentbox.config import Settings
from agentbox.errors import UnsupportedError


def test_refuses_without_a_binary_naming_the_fix() -> None:
    backend = FirecrackerBackend(Settings(firecracker_binary=None))
    with pytest.raises(UnsupportedError, match="AGENTBOX_FIRECRACKER_BINARY"):
        backend.check(SandboxSpec(name="fc", image="default"))
