"""The environment's part of a task's report, kept in the task dir between phases."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psutil

from agentbox.core.log import get_logger
from agentbox.egress import summarize
from agentbox.env._model import SetupReport
from agentbox.env._mount import EnvMount

log = get_logger(__name__)

_SETUP_FILE = "setup.json"
_PROXIES_FILE = "egress-proxies"
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


def record_proxy(task_root: Path, pid: int) -> None:
    """Note a running egress proxy of the task (pid and start time) in its dir."""
    try:
        start = psutil.Process(pid).create_time()
    except psutil.Error:
        return
    with (task_root / _PROXIES_FILE).open("a") as fh:
        fh.write(f"{pid} {start!r}\n")


def release_task_env(task_root: Path) -> None:
    """What a launcher that died left of a task's environment: end its egress proxies
    (each only if it is still that very process) and unmount its overlay; idempotent."""
    with contextlib.suppress(OSError):
        for line in (task_root / _PROXIES_FILE).read_text().splitlines()[:16]:
            with contextlib.suppress(ValueError, psutil.Error):
                pid, start = line.split()
                proc = psutil.Process(int(pid))
                if proc.create_time() == float(start):
                    log.warning("ending an orphan egress proxy", pid=proc.pid)
                    proc.kill()
    where = task_root / "env"
    if where.is_dir() and not where.is_symlink():
        EnvMount(Path("/nonexistent"), where).release()
