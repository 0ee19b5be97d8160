"""Publishing a finished task's kept result later: ``agentbox publish ID [--branch NAME]``.

The result commit stays in the task's trusted shadow git dir whether or not it
was published: a ``--no-publish`` task, or one whose branch was refused (the
user had their own ``agentbox/<id>``, or had it checked out). This puts it on
a branch of the task's repo with the same rules as publishing at the end of a
task (:func:`agentbox.collect.publish`: never over a ref agentbox did not
write), then records the branch in the store and the report.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from agentbox.collect import publish
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths, validate_task_id
from agentbox.errors import TaskError
from agentbox.launcher._finish import repo_at_use as _repo_at_use
from agentbox.launcher._store import Store
from agentbox.launcher.api import TaskInfo

__all__ = ["publish_task"]

log = get_logger(__name__)


def publish_task(
    settings: Settings, store: Store, task_id: str, *, branch: str | None = None
) -> TaskInfo:
    """Publish task ``task_id``'s result commit as ``branch`` (default ``agentbox/<id>``).

    Raises :class:`~agentbox.errors.TaskError` when the task is not finished or
    has no result commit, :class:`~agentbox.errors.PublishRefused` when the
    branch exists at a commit agentbox did not write (or is checked out), and
    :class:`~agentbox.errors.PathRefused` when the repo path no longer resolves
    to itself inside the repos root.
    """
    row = store.get(validate_task_id(task_id))
    if not row.info().terminal:
        raise TaskError(f"not finished (status {row.status})", task_id=row.id)
    if not row.commit_id:
        why = "the agent changed nothing" if row.changed is False else "no result was collected"
        raise TaskError(f"nothing to publish: {why}", task_id=row.id)
    paths = TaskPaths(settings.data_dir, row.id)
    if not paths.shadow_git.is_dir():
        raise TaskError(f"its result is gone ({paths.shadow_git} was removed)", task_id=row.id)
    repo = _repo_at_use(settings, row)
    name = publish(
        paths.shadow_git,
        repo,
        task_id=row.id,
        commit=row.commit_id,
        branch=branch,
        record=paths.root / "published.json",
        root=settings.repos_root,
    )
    store.update(row.id, branch=name)
    _note(paths, f"published {name} (agentbox publish)")
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(paths.report_file.read_text())
        if isinstance(report, dict):
            report["branch"] = name
            tmp = paths.report_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=2, default=str))
            tmp.replace(paths.report_file)
    log.info("published", task_id=row.id, branch=name, repo=str(repo))
    return store.get(row.id).info()


def _note(paths: TaskPaths, msg: str) -> None:
    with contextlib.suppress(OSError), Path(paths.log_dir / "launcher.log").open("a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
