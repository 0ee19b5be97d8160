"""The batch driver: place tasks, reserve the budget, fetch and publish results, resume.

:func:`run_batch` is independent of Ray: it drives an :class:`Executor` (the
Ray one places each attempt on a node with a free ``agentbox_slot``; the local
one runs them on this host's launcher, for tests and as the benchmark's
baseline). It yields a :class:`~agentbox.cluster.BatchResult` per task as
each one ends, and reports :class:`~agentbox.cluster.BatchEvent` s to
``on_event``.

Faults: an attempt whose node died (the executor says *lost*) is charged its
whole reservation, reported, and run again as ``<id>-r<n>`` wherever there is
room; its partial results are never fetched. A task publishes at most once
(the state says ``published`` before anything else can). A driver restarted
with the same batch id resumes from the SQLite file: finished tasks are not
re-run, published branches are not re-fetched, and an attempt that was
running is asked for again on the same node (the node's submit is idempotent).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from agentbox.cluster._gitio import add_result, bundle_base, changed_paths, ensure_shadow
from agentbox.cluster._spec import Attempt, BatchEvent, BatchResult, BatchTask, NodeOutcome
from agentbox.cluster._state import FINAL, BatchState, TaskRow, usd_or_none
from agentbox.collect import publish, risky_reason
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ConfigError
from agentbox.forge import check_remote
from agentbox.launcher.api import DEFAULT_BUDGET, DEFAULT_DEADLINE

log = get_logger(__name__)

#: Attempts of one task that may die with their node before it is failed.
MAX_LOST = 3
_BATCH_ID = re.compile(r"^[0-9a-z][0-9a-z-]{0,23}$")


class Executor(Protocol):
    """Where attempts run. Ray's, or this host's launcher."""

    def put(self, data: bytes) -> object:
        """Store a base bundle once; the handle goes to every attempt on that repo."""

    def place(
        self, attempt: Attempt, bundle: object, *, node: str | None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Start ``attempt`` (on ``node`` when given); the future holds the node's outcome."""

    def is_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the attempt died with its node (run it again elsewhere)."""

    def where(self) -> dict[str, str]:
        """Attempt id → node name, for attempts running now."""

    def cancel(self, attempt_id: str) -> None:
        """Ask whichever node runs ``attempt_id`` to cancel it."""


def new_batch_id() -> str:
    """A fresh batch id: ``b`` and 8 hex digits."""
    return "b" + secrets.token_hex(4)


def batch_dir(state_dir: Path, batch_id: str) -> Path:
    """Where a batch keeps its SQLite file, base bundles, results and shadow dirs."""
    if not _BATCH_ID.fullmatch(batch_id):
        raise ConfigError(f"not a batch id: {batch_id!r:.40} (use ^[0-9a-z][0-9a-z-]{{0,23}}$)")
    return Path(state_dir) / batch_id


def _private_dir(path: Path) -> Path:
    """``path`` (made if missing) as a 0700 directory: a batch's files hold task texts,
    repos and results, for its owner only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _write_private(path: Path, data: bytes | str) -> None:
    """Write ``path`` as a 0600 file (replacing it), never through a link."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _flag(changes: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The flagged paths of a result, from its changed paths (the driver's own reading)."""
    out = []
    for change, path in changes:
        why = risky_reason(path)
        if why is not None:
            out.append({"path": path, "change": change, "reason": why})
    return sorted(out, key=lambda f: f["path"])


def _checked_group(out: NodeOutcome, row: TaskRow) -> dict[str, Any] | None:
    """The node's group view (untrusted): re-validated, and its ids those of this attempt's
    group, or None (logged)."""
    if out.group is None:
        return None
    from agentbox.launcher.attempts import GroupView, attempt_id

    try:
        view = GroupView.model_validate(out.group)
    except ValidationError as exc:
        log.warning("a node's group view is malformed", attempt=row.attempt_id, error=str(exc))
        return None
    ids = [a.id for a in view.attempts]
    if view.group != row.attempt_id or ids != [attempt_id(row.attempt_id, k)
                                               for k in range(1, len(ids) + 1)]:  # fmt: skip
        log.warning("a node's group view names other tasks", attempt=row.attempt_id)
        return None
    keep = view.model_dump(mode="json", exclude={"repo"})  # the node's path means nothing here
    for a in keep["attempts"]:
        a.pop("test_command", None)  # the agent's text: not the driver's to show
    return keep


def _attempt_id(batch_id: str, key: str, n: int) -> str:
    return f"{batch_id}-{key}" + (f"-r{n}" if n else "")


class _Run:
    """One run of the driver over one batch (a fresh start or a resume)."""

    def __init__(
        self,
        state: BatchState,
        root: Path,
        executor: Executor,
        emit: Callable[[BatchEvent], None],
        opts: dict[str, Any],
    ) -> None:
        self.state, self.root, self.ex, self.emit, self.opts = state, root, executor, emit, opts
        self.batch_id: str = opts["batch_id"]
        self.budget: int | None = opts["budget"]
        self.bundles: dict[str, object] = {}
        self.placed_at: dict[str, tuple[float, float]] = {}

    def event(self, kind: str, row: TaskRow | None = None, **kw: Any) -> None:
        fields: dict[str, Any] = {"event": kind, "batch": self.batch_id}
        if row is not None:
            fields.update(key=row.key, attempt_id=row.attempt_id, node=row.node)
        fields.update(kw)
        self.emit(BatchEvent(**fields))

    def base_bundle(self, row: TaskRow) -> tuple[Path, object]:
        name = hashlib.sha256(row.repo.encode()).hexdigest()[:16]
        path = self.root / "bases" / f"{name}-{row.base[:12]}.bundle"
        if name not in self.bundles:
            self.bundles[name] = self.ex.put(path.read_bytes())
        return path, self.bundles[name]

    def flagged(self, row: TaskRow) -> tuple[str, ...]:
        """The flagged paths the driver found in the attempt's published result."""
        path = self.root / "results" / f"{row.attempt_id}.report.json"
        try:
            report = json.loads(path.read_text()) if row.branch else {}
        except (OSError, ValueError):
            return ()
        got = report.get("flagged") if isinstance(report, dict) else None
        return tuple(str(f["path"]) for f in got or () if isinstance(f, dict) and "path" in f)

    def group(self, row: TaskRow) -> dict[str, Any] | None:
        """A best-of-N task's group as the driver checked and kept it (None: one attempt)."""
        try:
            got = json.loads((self.root / "results" / f"{row.attempt_id}.group.json").read_text())
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) else None

    def result(self, row: TaskRow, *, resumed: bool = False) -> BatchResult:
        group = self.group(row)
        pick = group.get("pick") if group is not None else None
        return BatchResult(
            pick=pick if isinstance(pick, int) and not isinstance(pick, bool) else None,
            group=group,
            flagged=self.flagged(row),
            key=row.key,
            attempt_id=row.attempt_id,
            status=row.status if row.status else "skipped",  # type: ignore[arg-type]
            node=row.node,
            branch=row.branch,
            commit=row.commit,
            tokens=row.tokens,
            error=row.error,
            lost_attempts=row.lost,
            resumed=resumed,
            timings=self.opts["timings"].get(row.attempt_id, {}),
        )

    def attempt(self, row: TaskRow, attempt_id: str) -> Attempt:
        spec = BatchTask.model_validate(row.spec)
        return Attempt(
            attempt_id=attempt_id,
            task=spec.task,
            model=spec.model or self.opts["model"],
            budget=self.task_budget(row),
            deadline=spec.deadline or self.opts["deadline"] or DEFAULT_DEADLINE,
            base=row.base,
            boxfile=self.opts["boxfile"],
            attempts=spec.attempts or 1,
            budget_split=spec.budget_split,
        )

    def task_budget(self, row: TaskRow) -> int:
        b: int = row.spec.get("budget") or self.opts["task_budget"] or DEFAULT_BUDGET
        return b

    def collect(self, row: TaskRow, raw: dict[str, Any]) -> TaskRow:
        """Check and save a node's outcome, then publish it (once)."""
        try:
            out = NodeOutcome.model_validate(raw)
        except ValidationError as exc:
            out = NodeOutcome(
                attempt_id=row.attempt_id,
                node=str(raw.get("node", ""))[:128],
                status="failed",
                error=f"the node's outcome is malformed: {exc}"[:4000],
            )
        if out.attempt_id != row.attempt_id:
            out = NodeOutcome(
                attempt_id=row.attempt_id,
                node=out.node,
                status="failed",
                error=f"the node answered for {out.attempt_id}",
            )
        res = _private_dir(self.root / "results")
        if out.bundle:
            _write_private(res / f"{row.attempt_id}.bundle", out.bundle)
        # The node's flagged list is its claim, kept apart: the driver computes the list
        # it reports from the fetched tree (publish) and never takes the node's word.
        report = dict(out.report)
        report["flagged_by_node"] = report.pop("flagged", None)
        report["flagged"] = None
        _write_private(res / f"{row.attempt_id}.report.json", json.dumps(report, default=str))
        _write_private(res / f"{row.attempt_id}.transcript.json", out.transcript)
        group = _checked_group(out, row)
        if group is not None:
            _write_private(res / f"{row.attempt_id}.group.json", json.dumps(group))
        t = self.opts["timings"].setdefault(row.attempt_id, {})
        t.update(out.timings)
        if row.attempt_id in self.placed_at:
            placed_mono, placed_wall = self.placed_at[row.attempt_id]
            t["total"] = time.monotonic() - placed_mono
            if "received_at" in t and "done_at" in t:
                t["placement"] = t["received_at"] - placed_wall
                t["return"] = time.time() - t["done_at"]
        self.state.update(
            row.key,
            state="collected",
            status=out.status,
            node=out.node,
            commit=out.commit if out.bundle else "",
            tokens=out.tokens,
            cost_usd=usd_or_none(out.report.get("cost_usd")),
            error=out.error,
        )
        row = self.state.task(row.key)
        detail = out.error[:300]
        if group is not None:
            n = len(group["attempts"])
            pick = f"pick {group['pick']} of {n}" if group["pick"] else f"no pick of {n}"
            detail = f"{pick}; {detail}".rstrip("; ")
        self.event("finished", row, status=out.status, tokens=out.tokens, detail=detail)
        if group is not None:  # best-of-N: the group's scores and pick, as one JSON line
            self.event("group", row, status=out.status, detail=json.dumps(group))
        return self.publish(row)

    def check_flagged(self, row: TaskRow, flagged: list[dict[str, str]]) -> str:
        """Store the driver's flagged paths in the attempt's report; say how the node's
        own list differs from them ("" when it does not)."""
        path = self.root / "results" / f"{row.attempt_id}.report.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            report = {}
        if not isinstance(report, dict):
            report = {}
        claimed = report.get("flagged_by_node")
        report["flagged"] = flagged
        _write_private(path, json.dumps(report, default=str))
        said = {
            str(f.get("path"))
            for f in (claimed if isinstance(claimed, list) else [])
            if isinstance(f, dict)
        }
        ours = {f["path"] for f in flagged}
        if said == ours:
            return ""
        log.warning("a node's flagged paths differ from its result", attempt=row.attempt_id,
                    node=row.node, missing=sorted(ours - said)[:20])  # fmt: skip
        missing = ", ".join(sorted(ours - said)[:10]) or "-"
        extra = ", ".join(sorted(said - ours)[:10]) or "-"
        return (
            f"the node {row.node or '?'} misreported the flagged paths (left out: "
            f"{missing}; not in the result: {extra}); the driver's own list is kept"
        )

    def publish(self, row: TaskRow) -> TaskRow:
        """Fetch a collected result into the driver's repo as ``agentbox/<attempt>``."""
        t0 = time.monotonic()
        branch, error = "", row.error
        if row.commit:
            bundle = self.root / "results" / f"{row.attempt_id}.bundle"
            base_file, _ = self.base_bundle(row)
            shadow = self.root / "shadow" / f"{base_file.stem}.git"
            try:
                ensure_shadow(shadow, base_file.read_bytes(), row.base)
                add_result(shadow, bundle.read_bytes(), row.attempt_id, row.commit)
                lie = self.check_flagged(row, _flag(changed_paths(shadow, row.base, row.commit)))
                if lie:
                    error = f"{error}; {lie}".lstrip("; ")[:4000]
                branch = publish(
                    shadow,
                    Path(row.repo),
                    task_id=row.attempt_id,
                    commit=row.commit,
                    record=self.root / "published.json",
                )
            except (AgentboxError, OSError) as exc:
                error = f"{error}; not published: {exc}".lstrip("; ")[:4000]
        pr_url = ""
        if branch and self.opts.get("pr") and row.status == "done":
            pr_url, why = self.open_pr(row, branch)
            if why:
                error = f"{error}; no pull request: {why}".lstrip("; ")[:4000]
        self.state.update(row.key, state="published", branch=branch, error=error)
        self.opts["timings"].setdefault(row.attempt_id, {})["publish"] = time.monotonic() - t0
        row = self.state.task(row.key)
        if branch:
            self.event("published", row, detail=branch)
        if pr_url:
            self.event("pull_request", row, detail=pr_url)
        return row

    def open_pr(self, row: TaskRow, branch: str) -> tuple[str, str]:
        """``batch run --pr``: push ``branch`` to the repo's remote as the repo's owner and
        open a pull request with the attempt's report; (its URL, "") or ("", why not)."""
        from agentbox.config import load_settings
        from agentbox.forge import ship

        opts = self.opts["pr"]
        path = self.root / "results" / f"{row.attempt_id}.report.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            report = {}
        try:
            done = ship(
                load_settings(), Path(row.repo), task_id=row.attempt_id,
                task=str(row.spec.get("task", "")), branch=branch, commit=row.commit,
                report=report if isinstance(report, dict) else {}, remote=opts["remote"],
                pr=True, draft=bool(opts.get("draft")), env=dict(os.environ),
            )  # fmt: skip
        except AgentboxError as exc:
            log.warning("no pull request", attempt=row.attempt_id, error=str(exc))
            return "", str(exc)[:1000]
        url = done.pull_request.url if done.pull_request else ""
        if isinstance(report, dict) and url:
            report["pull_request"] = url
            _write_private(path, json.dumps(report, default=str))
        return url, ""


def run_batch(
    tasks: Iterable[tuple[str, BatchTask]] | None,
    *,
    executor: Executor,
    state_dir: Path,
    batch_id: str | None = None,
    model: str | None = None,
    budget: int | None = None,
    task_budget: int | None = None,
    deadline: float | None = None,
    boxfile: dict[str, Any] | None = None,
    max_in_flight: int | None = None,
    on_event: Callable[[BatchEvent], None] | None = None,
    pr: bool = False,
    draft: bool = False,
    remote: str = "origin",
) -> Iterator[BatchResult]:
    """Run ``tasks`` (``(key, task)`` pairs, as :func:`~agentbox.cluster.read_tasks`
    gives) and yield each task's result as it ends.

    ``budget`` caps the tokens of the whole batch: each task's budget (its own, or
    ``task_budget``, or the launcher's default) is reserved before it is placed; a
    task that cannot be covered once nothing else runs is ``skipped``. ``deadline``
    is each task's (seconds). ``boxfile`` is a Boxfile's TOML table, re-validated by
    each node within its own settings. With ``batch_id`` of an existing batch under
    ``state_dir``, the batch resumes (``tasks`` may then be None). With ``pr``, each
    published result of a task that ended done is pushed to ``remote`` of its repo (as
    the repo's owner, never by force) and a pull request (``draft``) opened with its
    report (:func:`agentbox.forge.ship`; the token from the environment, or as root the
    repo owner's secret); a failure is in the task's error, not the batch's.
    """
    batch_id = batch_id or new_batch_id()
    root = _private_dir(batch_dir(state_dir, batch_id))
    state = BatchState(root / "batch.db")
    emit = on_event or (lambda _e: None)
    try:
        opts = {
            "batch_id": batch_id,
            "model": model,
            "budget": budget,
            "task_budget": task_budget,
            "deadline": deadline,
            "boxfile": boxfile,
            "pr": {"remote": check_remote(remote), "draft": draft} if pr else None,
        }
        if not state.init(batch_id, budget=budget, options=opts):
            opts = {**state.batch()["options"], "batch_id": batch_id}
        opts["timings"] = {}
        run = _Run(state, root, executor, emit, opts)
        _add_tasks(state, root, tasks or ())
        run.event("batch", detail=f"{len(state.tasks())} tasks")
        yield from _drive(run, max_in_flight)
        run.event("end")
    finally:
        state.close()


def _add_tasks(state: BatchState, root: Path, tasks: Iterable[tuple[str, BatchTask]]) -> None:
    known = {r.key for r in state.tasks()}
    bases: dict[str, str] = {}
    for seq, (key, task) in enumerate(tasks):
        if key in known:
            continue
        repo = str(Path(task.repo).expanduser().resolve())
        if repo not in bases:
            base, data = bundle_base(Path(repo))
            name = hashlib.sha256(repo.encode()).hexdigest()[:16]
            _private_dir(root / "bases")
            _write_private(root / "bases" / f"{name}-{base[:12]}.bundle", data)
            bases[repo] = base
        state.add_task(key, seq, task.model_dump(), repo, bases[repo])


def _drive(run: _Run, max_in_flight: int | None) -> Iterator[BatchResult]:
    state, ex = run.state, run.ex
    flying: dict[concurrent.futures.Future[dict[str, Any]], str] = {}
    limit = max_in_flight or 1_000_000

    def launch(row: TaskRow, attempt_id: str, node: str | None) -> None:
        _, handle = run.base_bundle(row)
        run.placed_at[attempt_id] = (time.monotonic(), time.time())
        flying[ex.place(run.attempt(row, attempt_id), handle, node=node)] = row.key
        run.event("placed", state.task(row.key))

    for row in state.tasks():
        if row.state in FINAL:
            yield run.result(row, resumed=True)
        elif row.state == "collected":  # the driver died between fetching and publishing
            yield run.result(run.publish(row), resumed=True)
        elif row.state == "placed":  # ask again for the same attempt, on the same node
            launch(row, row.attempt_id, row.node or None)
    cancelled = False
    while True:
        if not cancelled and state.cancel_requested():
            cancelled = True
            for key in flying.values():
                ex.cancel(state.task(key).attempt_id)
        queued = [r for r in state.tasks() if r.state == "queued"]
        for row in queued:
            if cancelled:
                state.update(
                    row.key,
                    state="skipped",
                    status="cancelled",
                    error="the batch was cancelled before it ran",
                )
                row = state.task(row.key)
                run.event("skipped", row, detail=row.error)
                yield run.result(row)
                continue
            if len(flying) >= limit:
                break
            aid = _attempt_id(run.batch_id, row.key, row.attempt)
            if not state.place(row.key, aid, run.task_budget(row), run.budget):
                if flying:
                    break  # wait for a running task to settle its reservation
                state.update(
                    row.key,
                    state="skipped",
                    status="skipped",
                    error=f"the batch budget ({run.budget} tokens) cannot cover "
                    f"this task's {run.task_budget(row)}",
                )
                row = state.task(row.key)
                run.event("skipped", row, detail=row.error)
                yield run.result(row)
                continue
            launch(state.task(row.key), aid, None)
        if not flying:
            if not [r for r in state.tasks() if r.state == "queued"]:
                return
            continue
        done, _ = concurrent.futures.wait(
            list(flying), timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
        )
        _note_nodes(run, flying)
        for fut in done:
            key = flying.pop(fut)
            row = state.task(key)
            try:
                raw = fut.result()
            except BaseException as exc:
                if not ex.is_lost(exc):
                    state.update(
                        key,
                        state="failed",
                        status="failed",
                        error=f"the node failed the attempt: {exc}"[:4000],
                    )
                    row = state.task(key)
                    run.event("finished", row, status="failed", detail=row.error[:300])
                    yield run.result(row)
                    continue
                log.warning("attempt lost with its node", attempt=row.attempt_id, error=repr(exc))
                row = state.lose(key, f"{type(exc).__name__}: {exc}"[:300])
                run.event("lost", row, detail=row.lost[-1])
                if len(row.lost) >= MAX_LOST:
                    state.update(
                        key,
                        state="skipped",
                        status="failed",
                        error=f"{len(row.lost)} attempts lost with their nodes",
                    )
                    yield run.result(state.task(key))
                continue
            yield run.result(run.collect(row, raw if isinstance(raw, dict) else {}))


def _note_nodes(run: _Run, flying: dict[concurrent.futures.Future[dict[str, Any]], str]) -> None:
    """Record which node runs each attempt (for progress, and to resume on the same one)."""
    try:
        where = run.ex.where()
    except Exception:  # progress only: a node that does not answer now is not an error
        return
    for key in flying.values():
        row = run.state.task(key)
        node = where.get(row.attempt_id)
        if node and node != row.node:
            run.state.update(key, node=node)
            run.event("placed", run.state.task(key), detail="running")
