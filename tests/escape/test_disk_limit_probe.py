"""The escape suite's ``limits.disk`` probe (issue 11 item 6): it fires where /workspace
is unbounded, without writing there, and passes on a bounded one, where asking for
more than is free fails with ENOSPC. (In a real podman sandbox it passes:
tests/integration/test_podman_disk_limit.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

PROBE_PY = str(resources.files("agentbox.guest").joinpath("probe.py"))
MiB = 1024**2


def _probe(workspace: Path, size: int, inodes: int = 4096) -> dict[str, Any]:
    cfg = {"workspace": str(workspace), "disk": {"size": size, "inodes": inodes}}
    res = subprocess.run(
        [sys.executable, "-I", "-S", PROBE_PY, "--only", "limits.disk"],
        input=json.dumps(cfg).encode(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    return json.loads(res.stdout)["results"]["limits.disk"]  # type: ignore[no-any-return]


def test_fires_on_the_hosts_disk_without_writing(tmp_path: Path) -> None:
    r = _probe(tmp_path, 64 * MiB)
    assert r["ok"] is False and "larger than the limit" in r["seen"], r
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_passes_on_a_bounded_filesystem(tmp_path: Path) -> None:
    opts = "size=32m,nr_inodes=2048"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(tmp_path)], check=True)
    try:
        r = _probe(tmp_path, 64 * MiB, 4096)
        assert r["ok"] is True and "ENOSPC" in r["seen"], r
        assert list(tmp_path.iterdir()) == []
        # A limit smaller than the filesystem: the probe fires.
        assert _probe(tmp_path, 16 * MiB)["ok"] is False
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
