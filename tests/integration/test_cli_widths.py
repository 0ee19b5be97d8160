"""Issue 13 section 4: ``doctor`` and ``escape-test`` fit 80 columns, cut nothing, and
have no trailing padding when piped (the real commands, as their own processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _piped(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "80",
           "HOME": os.environ.get("HOME", "/root")}  # fmt: skip
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


def _fits(text: str) -> None:
    lines = text.splitlines()
    assert lines, "no output"
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert not [ln for ln in lines if ln != ln.rstrip()], "trailing padding on a pipe"
    assert "…" not in text, [ln for ln in lines if "…" in ln]  # nothing cut


def test_doctor_fits_80_columns() -> None:
    r = _piped("doctor")
    _fits(r.stdout)
    assert "facility" in r.stdout and "fix" in r.stdout


@pytest.mark.podman
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the escape suite runs sandboxes as root")
def test_escape_test_fits_80_columns() -> None:
    r = _piped("escape-test")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    _fits(r.stdout)
    assert "caps.effective" in r.stdout and " probes: " in r.stdout
