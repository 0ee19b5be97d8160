"""How a claimed pool sandbox looks to the detached verbs (``_pool_view``): the claim
record is trusted only as a private regular file of ours naming that very container."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.podman._detach import _when
from agentbox.backends.podman._pool_view import (
    POOL_DIR_LABEL,
    POOL_LABEL,
    POOL_LOG_KEY,
    POOL_NAME_LABEL,
    claim_record,
    pool_log,
    pool_view,
)


def _info(pool_dir: Path, name: str = "agentbox-task", cid: str = "c1") -> dict[str, Any]:
    labels = {POOL_LABEL: "k", POOL_DIR_LABEL: str(pool_dir), POOL_NAME_LABEL: "agentbox-pool-1"}
    return {
        "Id": cid,
        "Name": name,
        "Config": {"Labels": {**labels, "io.agentbox.seal": "pool-seal"}},
        "State": {"StartedAt": "2026-01-01T00:00:00.000000000Z", "Running": True},
    }


def _record(pool_dir: Path, name: str = "agentbox-task", **kw: object) -> Path:
    (pool_dir / "claims").mkdir(parents=True, exist_ok=True)
    rec = {
        "id": "c1",
        "slot": "agentbox-pool-1",
        "labels": {"io.agentbox.seal": "task-seal", "io.agentbox.deadline": "60"},
        "claimed_at": 1_800_000_000.5,
        "log": "/data/pool-logs/agentbox-pool-1.log",
        **kw,
    }
    path = pool_dir / "claims" / f"{name}.json"
    path.write_text(json.dumps(rec))
    path.chmod(0o600)
    return path


def test_a_claimed_sandbox_shows_its_task(tmp_path: Path) -> None:
    _record(tmp_path)
    view = pool_view(_info(tmp_path))
    labels = view["Config"]["Labels"]
    assert labels["io.agentbox.seal"] == "task-seal" and labels["io.agentbox.deadline"] == "60"
    assert _when(view["State"]["StartedAt"]) == pytest.approx(1_800_000_000.5)
    assert pool_log(view, Path("/task.log")) == Path("/data/pool-logs/agentbox-pool-1.log")


@pytest.mark.parametrize(
    "spoil",
    [
        "other-container",
        "other-slot",
        "symlink",
        "group-readable",
        "not-json",
        "huge",
        "no-pool-label",
        "relative-pool-dir",
    ],
)
def test_an_untrusted_record_changes_nothing(tmp_path: Path, spoil: str) -> None:
    info = _info(tmp_path)
    path = _record(tmp_path)
    if spoil == "other-container":
        info["Id"] = "c2"
    elif spoil == "other-slot":
        _record(tmp_path, slot="agentbox-pool-2")
    elif spoil == "symlink":
        real = tmp_path / "elsewhere.json"
        path.rename(real)
        path.symlink_to(real)
    elif spoil == "group-readable":
        path.chmod(0o640)
    elif spoil == "not-json":
        path.write_text("{not json")
    elif spoil == "huge":
        path.write_text(json.dumps({"pad": "x" * 70_000}))
    elif spoil == "no-pool-label":
        del info["Config"]["Labels"][POOL_LABEL]
    elif spoil == "relative-pool-dir":
        info["Config"]["Labels"][POOL_DIR_LABEL] = "pool"
    assert pool_view(info) is info
    assert pool_log(pool_view(info), Path("/task.log")) == Path("/task.log")
    assert POOL_LOG_KEY not in pool_view(info)


def test_a_name_cannot_climb_out_of_the_claims(tmp_path: Path) -> None:
    _record(tmp_path)
    assert claim_record(tmp_path, "../claims/agentbox-task") is None
    assert claim_record(tmp_path, ".hidden") is None
    assert os.geteuid() >= 0 and claim_record(tmp_path, "agentbox-task") is not None
