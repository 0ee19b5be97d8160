"""The environment's part of a task's report, kept in the task dir between phases."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from agentbox.egress import summarize
from agentbox.env._model import SetupReport
from agentbox.env._mount import EnvMount

__all__ = ["release_task_env", "report_fields", "save_setup_report"]

_SETUP_FILE = "setup.json"
_MAX_SETUP_FILE = 1 << 20


def save_setup_report(task_root: Path, report: SetupReport) -> None:
    """Keep ``report`` in the task dir (read back by :func:`report_fields`)."""
    tmp = task_root / f"{_SETUP_FILE}.tmp"
    tmp.write_text(report.model_dump_json(indent=2))
    tmp.replace(task_root / _SETUP_FILE)


def report_fields(task_root: Path, log_dir: Path) -> dict[str, Any]:
    """``{"setup": …, "egress": …}`` for ``report.json``: the setup phase (if any) and the
    agent phase's egress summary (if it had a proxy). Missing parts are left out."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with (task_root / _SETUP_FILE).open("rb") as fh:
            raw = fh.read(_MAX_SETUP_FILE)
        out["setup"] = SetupReport.model_validate_json(raw).model_dump(mode="json")
    agent_log = log_dir / "egress-agent.jsonl"
    if agent_log.exists():
        out["egress"] = summarize(agent_log).model_dump(mode="json")
    return out


def release_task_env(task_root: Path) -> None:
    """Unmount a task's environment overlay left by a launcher that died; idempotent."""
    where = task_root / "env"
    if where.is_dir() and not where.is_symlink():
        EnvMount(Path("/nonexistent"), where).release()
