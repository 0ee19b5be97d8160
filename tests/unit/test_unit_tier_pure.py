"""The unit tier is pure: no root, no sandbox, no service (``scripts/test.sh --fast``
runs it alone, in parallel). ``tests/unit/conftest.py`` fails a unit test at the spawn
of a sandbox program or service; a unit module may not skip unless root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent


def test_a_unit_test_may_not_start_a_container_runtime_or_a_vmm() -> None:
    for argv in (["podman", "ps"], ["/usr/bin/qemu-system-x86_64", "-version"]):
        with pytest.raises(pytest.fail.Exception, match="unit tests are pure"):
            subprocess.run(argv, capture_output=True, check=False)


def test_a_unit_test_may_not_start_an_agentbox_service() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"python -m agentbox\.gateway"):
        subprocess.run([sys.executable, "-m", "agentbox.gateway", "--help"], check=False)


def test_a_plain_subprocess_is_allowed() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0


def test_no_unit_module_needs_root() -> None:
    root_only = re.compile(r"geteuid\(\)\s*!=\s*0")
    needs = sorted(p.name for p in UNIT.glob("test_*.py") if root_only.search(p.read_text()))
    assert needs == [], f"these need root: move them to tests/integration: {needs}"
