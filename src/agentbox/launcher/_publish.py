"""Publishing a finished task's kept result later: ``agentbox publish ID [--branch NAME]``,
and pushing it to the repo's remote, with a pull request (``--push [--pr]``).

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
from collections.abc import Mapping
from pathlib import Path

from agentbox.collect import publish
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths, validate_task_id
from agentbox.errors import PublishRefused, TaskError
from agentbox.launcher._finish import repo_at_use as _repo_at_use
from agentbox.launcher._store import Store
from agentbox.launcher.api import TaskInfo
from agentbox.launcher.pushapi import PushInfo, PushRequest

log = get_logger(__name__)


def publish_task(
    settings: Settings,
    store: Store,
    task_id: str,
    *,
    branch: str | None = None,
    record: Path | None = None,
) -> TaskInfo:
    """Publish task ``task_id``'s result commit as ``branch`` (default ``agentbox/<id>``).

    ``record``: the file listing the commits agentbox wrote to the branch (default: the
    task's own); a best-of-N group's pick uses one file for the group, so a later
    ``publish GROUP --pick K`` may move ``agentbox/<group>`` from one attempt to another.

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
        record=record or paths.root / "published.json",
        root=settings.repos_root,
    )
    if record is not None:  # a group's pick: the task keeps its own branch
        _note(paths, f"published {name} (agentbox publish, the group's pick)")
        return store.get(row.id).info().model_copy(update={"branch": name})
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


def _public_url(url: str) -> str:
    """``url`` without a user name or password (``https://user:token@host/…``)."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" not in url:
        return url
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def push_task(
    settings: Settings,
    store: Store,
    task_id: str,
    req: PushRequest,
    *,
    env: Mapping[str, str] | None = None,
) -> PushInfo:
    """Publish task ``task_id``'s result (as :func:`publish_task`), push it to ``req.remote``
    as the repo's owner, and with ``req.pr`` open a pull request whose body is the report.

    The forge and token are checked before anything is pushed (a remote on no known
    forge, or no token, is a :class:`~agentbox.errors.ForgeError` with nothing sent).
    The token is the submitter's ``agentbox secret`` of the forge's name, else one in
    ``env`` (the environment of the user running ``publish``; the launcher passes none).
    """
    from agentbox import forge

    info = None
    # Refused: the branch is the user's now (they committed on it): the result itself is
    # pushed when it is in the repo, under the branch name asked for.
    with contextlib.suppress(PublishRefused):
        info = publish_task(settings, store, task_id, branch=req.branch)
    row = store.get(validate_task_id(task_id))
    assert row.commit_id  # publish_task's checks (a refusal comes after them)
    name = req.branch or (info.branch if info and info.branch else None) or f"agentbox/{row.id}"
    repo = _repo_at_use(settings, row)
    paths = TaskPaths(settings.data_dir, row.id)
    report: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(paths.report_file.read_text())
        report = loaded if isinstance(loaded, dict) else {}
    done = forge.ship(
        settings, repo, task_id=row.id, task=row.task, branch=name, commit=row.commit_id,
        report=report, remote=req.remote, pr=req.pr, draft=req.draft, base=req.base,
        uid=row.caller_uid, env=env, root=settings.repos_root,
    )  # fmt: skip
    pushed = done.pushed
    _note(paths, f"pushed {name} to {req.remote}" if pushed else f"{name} already on {req.remote}")
    out = PushInfo(task_id=row.id, branch=name, commit=row.commit_id, remote=req.remote,
                   remote_url=_public_url(done.remote_url), pushed=pushed)  # fmt: skip
    pr = done.pull_request
    if pr is None:
        return out
    _note(paths, f"pull request {pr.url}" + (" (already open)" if pr.existed else ""))
    with contextlib.suppress(OSError, ValueError):
        report["pull_request"] = pr.url
        tmp = paths.report_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(paths.report_file)
    log.info("pull request", task_id=row.id, url=pr.url, existed=pr.existed)
    return out.model_copy(update={"pull_request": pr.url, "number": pr.number,
                                  "existed": pr.existed})  # fmt: skip


def _note(paths: TaskPaths, msg: str) -> None:
    with contextlib.suppress(OSError), Path(paths.log_dir / "launcher.log").open("a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
