"""A task's ``[setup]`` phase: run (or reuse) the Boxfile's setup before the agent starts.

Called by :func:`agentbox.launcher._runner.run_task` between preparing the
workspace and starting the agent; a failed or cancelled setup finishes the task
(its report says what failed; no agent ran).
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

from agentbox.backends import get_backend
from agentbox.boxfile import Boxfile
from agentbox.collect import Report
from agentbox.core.log import get_logger
from agentbox.env import EnvPlan, prepare_env, save_setup_report
from agentbox.env import report_fields as env_report_fields
from agentbox.errors import AgentboxError
from agentbox.gateway import GatewayHandle, gateway_identity
from agentbox.launcher import _session
from agentbox.launcher._context import TaskContext
from agentbox.launcher._finish import load_base, stop_gateway
from agentbox.launcher._names import sandbox_labels

log = get_logger(__name__)


def setup_phase(
    ctx: TaskContext, box: Boxfile, gateway_future: concurrent.futures.Future[GatewayHandle]
) -> EnvPlan | None:
    """Run (or reuse) the task's ``[setup]``; None when it failed and the task is finished."""
    settings, store, paths, tlog = ctx.settings, ctx.store, ctx.paths, ctx.tlog
    task_id, cancelled = ctx.task_id, ctx.cancelled
    error = None
    plan = None
    row = store.get(task_id)
    try:
        plan = prepare_env(
            settings,
            box,
            get_backend(box.backend, settings),
            task_id=task_id,
            task_root=paths.root,
            workspace=paths.workspace,
            log_dir=paths.log_dir,
            labels=sandbox_labels(settings, task_id),
            proxy_identity=gateway_identity(settings),
            cancelled=cancelled,
            tlog=tlog,
            user=row.caller_uid,
            repo=Path(row.repo),
            resumed=_session.continues(settings, paths),
        )
        save_setup_report(paths.root, plan.report)
        if plan.failed:
            r = plan.report
            last = r.output_tail.strip().splitlines()[-1:] or [""]
            why = "deadline" if r.timed_out else r.exit_words
            error = f"setup failed ({why}); no agent ran: {last[0][:300]}"
    except (AgentboxError, OSError) as exc:
        # OSError: freezing what setup made (a move, a mount) failed on the host.
        log.error("setup phase failed", task_id=task_id, error=str(exc))
        error = f"setup failed: {exc}"[:4000]
    if error is None and cancelled():
        error = "cancelled during setup"
    if error is None:
        return plan
    if plan is not None:
        plan.release()
    tlog(error)
    stop_gateway(gateway_future)
    base = load_base(paths)
    report = Report(
        task_id=task_id,
        status="cancelled" if error.startswith("cancelled") else "failed",
        model=store.get(task_id).model,
        base_commit=base.base_commit if base is not None else None,
        error=error,
    )
    data = report.model_dump(mode="json")
    data["agent_ran"] = False  # show's changes row: "none: the agent never started"
    data.update(env_report_fields(paths.root, paths.log_dir))
    paths.report_file.write_text(json.dumps(data, indent=2, default=str))
    store.finish(task_id, report.status, error=error)
    return None
