"""The in-process launcher: validate, queue, run, collect, reconcile.

:class:`Launcher` is the Python API the CLI uses and the unix-socket server
wraps. Tasks run on a bounded pool of worker threads; each one goes::

    queued ─▶ running ─▶ collecting ─▶ done | failed | timed_out | cancelled

and the per-task work itself is in :mod:`agentbox.launcher._runner`. State
lives in SQLite (:mod:`agentbox.launcher._store`) so that another process can
list, show and cancel tasks, and a restarted launcher can :meth:`reconcile`
the tasks whose owner died: it runs their queued tasks, re-adopts their running
detached ones and settles the rest (:mod:`agentbox.launcher._adopt`).

Workers are daemon threads fed in submission order: a launcher that exits (or
is stopped without ``--drain``/``--cancel``) leaves its detached tasks running
and its queued ones queued, for the next launcher.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import (
    TaskPaths,
    check_inside,
    new_task_id,
    private_data_dir,
    validate_task_id,
)
from agentbox.env import COMMITTED_BOXFILE, check_env_policy, committed_boxfile, with_overrides
from agentbox.errors import (
    AgentboxError,
    PathRefused,
    RefusedError,
    TaskError,
    TaskIdRefused,
    TaskNotFound,
)
from agentbox.gateway import load_registry, read_usage
from agentbox.launcher import _finish, _session
from agentbox.launcher._adopt import adopt, take_over
from agentbox.launcher._cancel import cancel_task
from agentbox.launcher._groupbudget import check_split, group_spent, is_shared, make_budget_file
from agentbox.launcher._reach import check_local_upstream
from agentbox.launcher._store import Owner, Store, TaskRow
from agentbox.launcher._uidslot import run_in_slot
from agentbox.launcher._validate import git_readonly, validate
from agentbox.launcher.api import (
    ModelInfo,
    TaskInfo,
    TaskRequest,
    TaskResult,
    TokenUsage,
)
from agentbox.launcher.attempts import (
    MAX_ATTEMPTS,
    GroupView,
    attempt_id,
    budget_share,
    pick,
    score,
)
from agentbox.launcher.pushapi import PushInfo, PushRequest
from agentbox.observe.resources import read_resources
from agentbox.transcript import TranscriptPage
from agentbox.transcript import page as transcript_page

#: In a group's first attempt's dir: the commits agentbox wrote to ``agentbox/<group>``.
_GROUP_RECORD = "group-published.json"

log = get_logger(__name__)

#: Tasks run at once by one launcher unless told otherwise.
DEFAULT_MAX_TASKS = 4

#: How a launcher stops: ``leave`` its running tasks (detached ones are re-adopted by the
#: next launcher), ``drain`` (take no new task, wait for the queued and running ones), or
#: ``cancel`` them (each collected as ``cancelled``).
StopMode = Literal["leave", "drain", "cancel"]

#: Seconds between two looks at the store while waiting for a task another process runs
#: (one this launcher runs wakes the waiter when it ends).
WAIT_POLL = 0.2


def tokens_from_usage(paths: TaskPaths) -> TokenUsage | None:
    """The gateway's running totals for a task, or None when there are none yet."""
    try:
        u = read_usage(paths.usage_file)
    except AgentboxError:
        return None
    return TokenUsage(
        input=u.input, output=u.output, cache_creation=u.cache_creation, cache_read=u.cache_read,
        cost_usd=u.cost_usd,
    )  # fmt: skip


class Launcher:
    """Runs delegated tasks. Clients choose which task and model, never how.

    ``max_tasks`` bounds the tasks that run at once (more are queued).

    Every call that names or lists tasks takes ``caller``: the uid of whoever asks,
    as the socket server read it from the kernel (``SO_PEERCRED``). A non-root
    caller sees, reads and cancels only the tasks it submitted (another's task is
    :class:`~agentbox.errors.TaskNotFound`, as if it did not exist) and may
    delegate only a repo it owns. ``caller`` None is the in-process API (the CLI,
    whose user can read the store anyway): unscoped, and a submitted task is
    recorded as the effective uid's. Root (0) sees all.
    """

    def __init__(self, settings: Settings, *, max_tasks: int = DEFAULT_MAX_TASKS) -> None:
        self.settings = settings
        private_data_dir(settings.data_dir)  # closed to other users
        self.store = Store(settings.data_dir / "state.db")
        self.max_tasks = max(1, max_tasks)
        self._queue: queue.SimpleQueue[tuple[str, threading.Event] | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._worker, name=f"agentbox-task-{i}", daemon=True)
            for i in range(self.max_tasks)
        ]
        self._cancel: dict[str, threading.Event] = {}
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self._picks = threading.RLock()
        # Notified when a task this launcher ran ends (``wait`` wakes at once, not at its
        # next poll); a task another process runs is still polled.
        self._ended = threading.Condition(self._lock)
        self._ends = 0
        self._owner = Owner.me()
        self._closed = False
        self._run_queued = True  # on close: run what is queued (False: leave it queued)
        self.draining = False
        for w in self._workers:
            w.start()

    # -- the API -----------------------------------------------------------

    def submit(
        self,
        request: TaskRequest,
        *,
        boxfile: Boxfile | None = None,
        caller: int | None = None,
        overrides: dict[str, str] | None = None,
        attempt: tuple[str, int, int] | None = None,
        budget_split: str = "split",
    ) -> TaskInfo:
        """Validate ``request`` and queue it. Refused requests create nothing.

        ``attempt`` ``(group, k, n)``: the task is attempt ``k`` of ``n`` of a best-of-N
        group (:meth:`submit_group`): with ``budget_split`` ``split`` its token and dollar
        budgets are the group's (as validated) divided by ``n``; ``shared``: the whole
        group's, charged to one ledger with the other attempts (:mod:`._groupbudget`).

        ``boxfile`` (Python API and CLI only; never over the socket) chooses the
        image, runtime, resources and read-only mounts, within the settings.
        ``overrides`` (``run --backend/--runtime``) replace those keys only, of
        ``boxfile`` or else of the repo's committed Boxfile; the rest is kept.
        A non-root ``caller`` must own the repo (its directory), as the MCP server
        checks on its side: the launcher publishes into it as root.
        """
        if self.draining or self._closed:
            raise RefusedError("the launcher is stopping (draining): it takes no new task")
        registry = load_registry(self.settings)
        with concurrent.futures.ThreadPoolExecutor(1) as side:
            # The repo's own .agentbox/Boxfile.toml, from its commit (never the work tree),
            # looked up beside the validation's git questions (all read-only; its answer
            # taken only for the repo the validation then found); a client over the socket
            # (MCP delegate) can never pass a Boxfile of its own.
            committed = None if boxfile is not None else side.submit(self._committed, request)
            v = validate(request, self.settings, registry, boxfile=boxfile)
        check_local_upstream(registry.get(v.model))  # a local model server that is down
        source = "the --boxfile"
        if committed is not None:
            looked_in, boxfile = committed.result()
            if looked_in != v.repo:  # the path resolved elsewhere meanwhile: ask again
                boxfile = committed_boxfile(v.repo, self.settings, git_readonly)
            source = f"the repo's {COMMITTED_BOXFILE}" if boxfile else "the host's defaults"
            if boxfile is not None:
                v = validate(request, self.settings, registry, boxfile=boxfile, repo_checked=v.repo)
        if overrides:
            base = boxfile or Boxfile.from_dict({}, settings=self.settings)
            boxfile = with_overrides(base, overrides, source=source)
        if caller not in (None, 0):
            owner = v.repo.stat().st_uid
            if owner != caller:
                raise PathRefused(
                    f"repo is owned by uid {owner}, not by the caller (uid {caller})",
                    path=v.repo,
                )
        box = boxfile or Boxfile.from_dict({}, settings=self.settings)
        if attempt is not None and budget_split == "shared":
            if attempt[1] == 1:  # one ledger for the group, made with its first attempt
                make_budget_file(self.settings, attempt[0], v.budget, v.budget_usd)
        elif attempt is not None:
            # Split: each attempt gets 1/n of the group's budget, so n never exceed it.
            shares = budget_share(v.budget, attempt[2])
            usd = v.budget_usd / attempt[2] if v.budget_usd is not None else None
            v = dataclasses.replace(v, budget=shares[attempt[1] - 1], budget_usd=usd)
        if v.budget_usd != box.budget_usd:
            # Recorded with the Boxfile, which the runner reads back (no new column).
            box = box.model_copy(update={"budget_usd": v.budget_usd})
        if box.mounts:
            box.check_mounts(self.settings)
        check_env_policy(box, self.settings)
        prev = self._row(request.continue_from, caller) if request.continue_from else None
        cont = _session.plan(self.settings, prev, v.repo, v.include_uncommitted)  # resume
        now = time.time()
        self.store.insert(
            id=v.task_id,
            status="queued",
            repo=str(v.repo),
            task=v.task,
            model=v.model,
            budget=v.budget,
            deadline=v.deadline,
            include_uncommitted=int(v.include_uncommitted),
            publish=int(v.publish),
            boxfile=box.model_dump_json(),
            created_at=now,
            backend=box.backend,
            owner_pid=self._owner.pid,
            owner_start=self._owner.start,
            caller_uid=os.geteuid() if caller is None else caller,
            group_id=attempt[0] if attempt is not None else None,
            attempt=attempt[1] if attempt is not None else None,
        )
        _session.record(self.settings, v.task_id, cont)
        log.info("task queued", task_id=v.task_id, repo=str(v.repo), model=v.model, caller=caller)
        self._enqueue(v.task_id)
        return self.get(v.task_id)

    def _committed(self, request: TaskRequest) -> tuple[Path | None, Boxfile | None]:
        """The Boxfile committed in ``request``'s repo, and the directory asked (None: the
        path is not one validation takes; its refusal is validation's to say)."""
        try:
            real = check_inside(self.settings.repos_root, Path(request.repo), what="repo")
        except (AgentboxError, OSError, ValueError):
            return None, None
        if not (real / ".git").exists():
            return None, None
        return real, committed_boxfile(real, self.settings, git_readonly)

    def submit_group(
        self,
        request: TaskRequest,
        attempts: int,
        *,
        boxfile: Boxfile | None = None,
        caller: int | None = None,
        overrides: dict[str, str] | None = None,
        budget_split: str = "split",
    ) -> builtins.list[TaskInfo]:
        """Queue ``attempts`` (1..8) attempts of ``request`` as one best-of-N group whose id
        is ``request.task_id`` (or a fresh one): tasks ``<group>-a1`` … ``-aN``, each with
        its own sandbox, gateway and branch, sharing the base commit's copy rules and the
        frozen environment (its key is the same for all). The group's budget is split
        (``budget // N`` tokens each) or, ``budget_split="shared"``, one budget all the
        attempts draw from, never passed in total. The attempts are validated alike: a
        request refused is refused at the first, before any is queued."""
        if not 1 <= attempts <= MAX_ATTEMPTS:
            raise RefusedError(f"--attempts must be 1..{MAX_ATTEMPTS}, got {attempts}")
        check_split(budget_split)
        group = validate_task_id(request.task_id) if request.task_id else new_task_id()
        if len(group) > 60:
            raise RefusedError("a group id is at most 60 characters (its attempts add -aN)")
        if self.store.group(group) or self.store.exists(group):
            raise TaskIdRefused(f"a task or group with the id {group} exists")
        infos: builtins.list[TaskInfo] = []
        for k in range(1, attempts + 1):
            req = request.model_copy(update={"task_id": attempt_id(group, k)})
            infos.append(
                self.submit(
                    req,
                    boxfile=boxfile,
                    caller=caller,
                    overrides=overrides,
                    attempt=(group, k, attempts),
                    budget_split=budget_split,
                )
            )
        return infos

    def group(self, group: str, *, caller: int | None = None) -> builtins.list[TaskInfo]:
        """The attempts of ``group`` (TaskNotFound: none the caller may see)."""
        rows = [
            r for r in self.store.group(validate_task_id(group))
            if caller in (None, 0) or r.caller_uid == caller
        ]  # fmt: skip
        if not rows:
            raise TaskNotFound("no such group", task_id=group)
        return [self._info(r) for r in rows]

    def get(self, task_id: str, *, caller: int | None = None) -> TaskInfo:
        """The task's state; live token counts while it runs."""
        return self._info(self._row(task_id, caller))

    def list(self, *, caller: int | None = None) -> builtins.list[TaskInfo]:
        """Every task ``caller`` may see, newest first."""
        rows = self.store.all() if caller in (None, 0) else self.store.all(caller_uid=caller)
        return [self._info(r) for r in rows]

    def _info(self, row: TaskRow) -> TaskInfo:
        """The row's public view, with live tokens and what its sandbox used."""
        info = row.info(self._live_tokens(row))
        if row.status == "queued":
            return info
        used = read_resources(TaskPaths(self.settings.data_dir, row.id).root)
        return info.model_copy(update={"resources": used}) if used is not None else info

    def _live_tokens(self, row: TaskRow) -> TokenUsage | None:
        """A running task's tokens from its gateway's usage file (the row has them at the end)."""
        if row.status not in ("running", "collecting"):
            return None
        return tokens_from_usage(TaskPaths(self.settings.data_dir, row.id))

    def cancel(self, task_id: str, *, caller: int | None = None) -> TaskInfo:
        """Stop a task. One no worker took never starts; one taken is stopped, killed and
        collected by its worker, and ends ``cancelled`` then (:mod:`._cancel`)."""
        row = self._row(task_id, caller)
        if not row.info().terminal:
            with self._lock:
                event = self._cancel.get(row.id)
            cancel_task(self.settings, self.store, row, event, self._owner)
        return self.get(row.id)

    def result(self, task_id: str, *, caller: int | None = None) -> TaskResult:
        """The finished task's report, diff and branch; TaskError while it runs."""
        row = self._row(task_id, caller)
        if not row.info().terminal:
            raise TaskError(f"not finished (status {row.status})", task_id=row.id)
        paths = TaskPaths(self.settings.data_dir, row.id)
        report: dict[str, object] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(paths.report_file.read_text())
            if isinstance(loaded, dict):
                report = loaded
        diff, truncated = _finish.read_diff(paths)
        return TaskResult(
            task_id=row.id,
            status=row.status,  # type: ignore[arg-type]
            report=report,
            diff=diff,
            diff_truncated=truncated,
            branch=row.branch or "",
            shadow_git=str(paths.shadow_git) if paths.shadow_git.is_dir() else "",
            commit=row.commit_id or "",
            changed=row.changed,
            tokens=(info := row.info()).tokens,
            cost_usd=info.tokens.cost_usd,
        )

    def transcript(
        self, task_id: str, *, since: int = 0, limit: int = 200, caller: int | None = None
    ) -> TranscriptPage:
        """A page of the task's transcript (what the agent ran and what came back), while
        it runs or after; ``since`` < 0 reads the last ``-since`` events."""
        row = self._row(task_id, caller)
        root = TaskPaths(self.settings.data_dir, row.id).root
        return transcript_page(row.id, root, since=since, limit=limit, created_at=row.created_at)

    def publish(self, task_id: str, *, branch: str | None = None) -> TaskInfo:
        """Publish a finished task's kept result as ``branch`` (default ``agentbox/<id>``).

        For ``--no-publish`` tasks and results whose branch was refused; never
        overwrites a ref agentbox did not write (see :mod:`agentbox.launcher._publish`).
        """
        from agentbox.launcher._publish import publish_task

        return publish_task(self.settings, self.store, task_id, branch=branch)

    def group_view(self, group: str, *, by: str = "tests", caller: int | None = None) -> GroupView:
        """The group's attempts scored, and its pick by rule ``by``
        (:func:`agentbox.launcher.attempts.pick`; ``branch``: ``agentbox/<group>`` once
        a pick was published)."""
        scores = []
        for info in self.group(group, caller=caller):
            res = None
            if info.terminal:
                with contextlib.suppress(AgentboxError):
                    res = self.result(info.id, caller=caller)
            scores.append(score(info.attempt or 0, info, res))
        chosen = pick(scores, by)
        record = TaskPaths(self.settings.data_dir, attempt_id(group, 1)).root / _GROUP_RECORD
        with self._picks:  # the record is written before the ref: not while one is published
            published = record.exists()
        return GroupView(
            group=group,
            repo=self.group(group, caller=caller)[0].repo,
            pick_by=by,
            attempts=scores,
            pick=chosen.attempt if chosen else None,
            pick_id=chosen.id if chosen else None,
            branch=f"agentbox/{group}" if published else None,
            budget_split="shared" if is_shared(self.settings, group) else "split",
            group_spent=group_spent(self.settings, group),
        )

    def publish_pick(self, group: str, k: int, *, caller: int | None = None) -> TaskInfo:
        """Publish attempt ``k`` of ``group`` as ``agentbox/<group>`` (its own
        ``agentbox/<group>-aK`` stays); a later call with another ``k`` moves the branch
        (never a ref agentbox did not write)."""
        from agentbox.launcher._publish import publish_task

        task_id = attempt_id(group, k)
        self._row(task_id, caller)  # TaskNotFound for another user's
        record = TaskPaths(self.settings.data_dir, attempt_id(group, 1)).root / _GROUP_RECORD
        with self._picks:  # one publisher of a group's branch at a time
            return publish_task(
                self.settings, self.store, task_id, branch=f"agentbox/{group}", record=record
            )

    def _group_ended(self, task_id: str) -> None:
        """When the last attempt of a best-of-N group that publishes has ended: publish its
        pick (by ``tests``) as ``agentbox/<group>``, once (a detached group, an MCP
        ``delegate(attempts=N)``). Never the task's failure: logged."""
        try:
            row = self.store.get(task_id)
            if row.group_id is None or not row.publish:
                return
            rows = self.store.group(row.group_id)
            if not all(r.info().terminal for r in rows):
                return
            with self._picks:  # the last two attempts may end together, beside a client's call
                view = self.group_view(row.group_id)
                if view.pick is not None and view.branch is None:
                    self.publish_pick(row.group_id, view.pick)
        except (AgentboxError, OSError) as exc:
            log.warning("publishing a group's pick failed", task_id=task_id, error=str(exc))

    def push(
        self,
        task_id: str,
        req: PushRequest,
        *,
        caller: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> PushInfo:
        """Publish, push the result branch to ``req.remote`` as the repo's owner (never by
        force) and, with ``req.pr``, open a pull request (see :mod:`agentbox.forge`).
        ``env``: where a forge token may come from besides the submitter's secrets."""
        from agentbox.launcher._publish import push_task

        row = self._row(task_id, caller)
        return push_task(self.settings, self.store, row.id, req, env=env)

    def wait(
        self, task_id: str, timeout: float | None = None, *, caller: int | None = None
    ) -> TaskInfo:
        """Block until the task is terminal; TaskError past ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                seen = self._ends
            info = self.get(task_id, caller=caller)
            if info.terminal:
                return info
            now = time.monotonic()
            if end is not None and now >= end:
                raise TaskError(f"still {info.status} after {timeout:g}s", task_id=task_id)
            self._wait_for_an_end(seen, WAIT_POLL if end is None else min(WAIT_POLL, end - now))

    def models(self) -> builtins.list[ModelInfo]:
        """The models a task may name; the default first."""
        reg = load_registry(self.settings)
        out = [
            ModelInfo(
                name=e.name,
                kind=e.kind,
                default=e.name == reg.default,
                description=e.description,
                available=e.unavailable() is None,
                unavailable_reason=e.unavailable() or "",
                default_reason=reg.default_reason if e.name == reg.default else "",
            )
            for e in reg
        ]
        return sorted(out, key=lambda m: (not m.default, m.name))

    def reconcile(self, *, adopt: bool = True) -> builtins.list[str]:
        """Take over the tasks whose launcher died (oldest first, each claimed: one
        reconciler wins), remove orphan sandboxes; return the ids taken over.

        Queued again (nothing of the agent ran), re-adopted, collected again, or
        settled: see :mod:`agentbox.launcher._adopt`. ``adopt=False`` (a foreground
        ``agentbox run``, which must not wait for anyone else's task): what a launcher
        could run or re-adopt is left alone, sandbox and gateway too, for the service.
        """
        settled, requeued, adopted = take_over(self.settings, self.store, self._owner, adopt=adopt)
        for row in adopted:
            self._start_adopted(row)
        for task_id in requeued:
            self._enqueue(task_id)
        return settled

    def stop(self, mode: StopMode = "leave", *, grace: float = 60.0) -> None:
        """Stop this launcher: ``leave`` (running detached tasks go on and are re-adopted
        by the next launcher; queued ones stay queued for it; attached ones are
        cancelled and collected), ``drain`` (no new task; wait for every queued and
        running one), or ``cancel`` (every task cancelled and collected)."""
        self.draining = True
        self._run_queued = mode == "drain"
        if mode == "drain":
            while True:
                with self._lock:
                    if not self._cancel:
                        break
                    seen = self._ends
                self._wait_for_an_end(seen, WAIT_POLL)
        elif mode == "cancel":
            self.shutdown(grace=grace)
            return
        else:
            with self._lock:
                running = [t for t in self._active if self.store.get(t).stage != "launched"]
            for task_id in running:
                with contextlib.suppress(AgentboxError):
                    self.cancel(task_id)
            end = time.monotonic() + grace
            for task_id in running:
                with contextlib.suppress(AgentboxError):
                    self.wait(task_id, max(0.1, end - time.monotonic()))
        self.close(wait=False)

    def shutdown(self, *, grace: float = 60.0) -> None:
        """Cancel the tasks this launcher runs or queued, let them be collected, then close.

        Used by ``agentbox run`` when interrupted and ``launcher stop --cancel``: every
        task ends as ``cancelled`` with its partial result collected.
        """
        with self._lock:
            running = list(self._cancel)
        for task_id in running:
            with contextlib.suppress(AgentboxError):
                self.cancel(task_id)
        end = time.monotonic() + grace
        for task_id in running:
            with contextlib.suppress(AgentboxError):
                self.wait(task_id, max(0.1, end - time.monotonic()))
        self.close(wait=False)

    def close(self, *, wait: bool = True) -> None:
        """Stop taking tasks; with ``wait``, let running and queued ones finish. Idempotent.

        Without ``wait``, tasks not yet started stay ``queued`` in the store (the next
        launcher runs them) and running ones go on on their (daemon) threads.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._run_queued = wait
        for _ in self._workers:
            self._queue.put(None)
        if wait:
            for w in self._workers:
                w.join()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _row(self, task_id: str, caller: int | None) -> TaskRow:
        """The task's row if ``caller`` may see it; TaskNotFound otherwise (no hint it exists)."""
        row = self.store.get(validate_task_id(task_id))
        if caller not in (None, 0) and row.caller_uid != caller:
            raise TaskNotFound("no such task", task_id=row.id)
        return row

    def _enqueue(self, task_id: str) -> None:
        event = threading.Event()
        with self._lock:
            self._cancel[task_id] = event
        self._queue.put((task_id, event))

    def _worker(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._closed and not self._run_queued:
                # Stopped without waiting: leave what was not started queued.
                with self._lock:
                    self._cancel.pop(item[0], None)
                continue
            self._work(*item)

    def _wait_for_an_end(self, seen: int, timeout: float) -> None:
        """Sleep until a task of this launcher ends after ``seen`` ends, at most ``timeout``."""
        with self._ended:
            self._ended.wait_for(lambda: self._ends != seen, timeout)

    def _start_adopted(self, row: TaskRow) -> None:
        """Follow a re-adopted task on its own thread (it runs already: no queue slot)."""
        event = threading.Event()
        with self._lock:
            self._cancel[row.id] = event
        job = lambda: adopt(self.settings, self.store, row, event)  # noqa: E731
        name = f"agentbox-adopt-{row.id}"
        threading.Thread(
            target=self._work, args=(row.id, event, job), name=name, daemon=True
        ).start()

    def _work(
        self, task_id: str, cancel: threading.Event, job: Callable[[], None] | None = None
    ) -> None:
        with self._lock:
            self._active.add(task_id)
        try:
            if job is not None:
                job()
            else:
                run_in_slot(self.settings, self.store, task_id, cancel)
        except BaseException as exc:  # never lose a task to an unexpected error
            log.error("task crashed", task_id=task_id, error=repr(exc))
            self.store.finish(task_id, "failed", error=f"launcher error: {exc!r}"[:2000])
        finally:
            self._group_ended(task_id)
            with self._lock:
                self._cancel.pop(task_id, None)
                self._active.discard(task_id)
                self._ends += 1
                self._ended.notify_all()
