"""One task, from a queued row to a terminal state with its result collected.

The order matters and each step is refused or recorded before the next:

1. the task dir is made fresh (an existing one is refused: the launcher only
   hands out workspaces it made), the repo copied at its base commit by
   :func:`agentbox.collect.prepare`, and the workspace given to the sandbox uid
   without following links, then checked to be owned by it;
2. a fresh one-time token is written 0600 in the task dir (never mounted) and
   the task's own gateway started on a socket in ``gw/``, the only directory
   mounted besides the workspace;
3. the sandbox runs ``claude -p …`` (the argv and environment checked against
   policy) under the backend's own deadline, with a watchdog process as the
   second line and a monitor thread that turns a cancel into a kill;
4. whatever happened (exit, crash, deadline, budget, cancel), the workspace is
   collected into the shadow git dir, published as ``agentbox/<id>`` and a
   report written; tokens come from the gateway's usage file only. An agent
   that changed nothing gets no commit and no branch: the task finishes with
   ``changed`` False, an empty diff and a report that says "no changes".

A launcher killed at any point leaves the task dir and its row; a restarted
launcher finishes the job with :func:`finish_orphan`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import grp
import hashlib
import json
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import psutil
from pydantic import TypeAdapter

from agentbox import _proc
from agentbox._acl import grant_search
from agentbox._log import get_logger
from agentbox.backends import get_backend
from agentbox.backends.base import BindMount, SandboxSpec
from agentbox.boxfile import Boxfile
from agentbox.collect import Base, Report, Skipped, branch_name, collect, prepare, publish
from agentbox.config import Settings
from agentbox.egress import EgressPolicy
from agentbox.env import (
    Egress,
    EnvPlan,
    egress_argv,
    prepare_env,
    release_task_env,
    save_setup_report,
    start_egress,
)
from agentbox.env import report_fields as env_report_fields
from agentbox.errors import AgentboxError, PathRefused, PolicyRefused, PublishRefused
from agentbox.gateway import (
    GatewayHandle,
    Usage,
    gateway_identity,
    read_usage,
    spawn_gateway,
)
from agentbox.launcher._agent import agent_argv, agent_env, check_agent_argv, check_env
from agentbox.launcher._store import Owner, Store, TaskRow
from agentbox.launcher._watchdog import kill_sandbox, spawn_watchdog, stop_watchdog
from agentbox.launcher._workspace import check_owner, ensure_private_dir, give_to_sandbox
from agentbox.launcher.api import NO_CHANGES, TokenUsage
from agentbox.paths import TaskPaths, check_inside
from agentbox.sandbox import spec_from_boxfile
from agentbox.transcript import summary as transcript_summary

__all__ = [
    "SANDBOX_LABEL",
    "finish_orphan",
    "kill_gateway",
    "list_task_gateways",
    "list_task_sandboxes",
    "read_diff",
    "run_task",
    "sandbox_name",
]

log = get_logger("launcher.task")

#: Label naming the task a sandbox belongs to (orphans are found by it).
SANDBOX_LABEL = "io.agentbox.task"
#: Label naming the data dir (hashed) whose launcher owns the sandbox.
DATA_LABEL = "io.agentbox.data"
#: Seconds past the deadline after which the watchdog process removes the sandbox.
WATCHDOG_GRACE = 30.0
#: Each of the agent's log files (stdout, stderr) is capped.
MAX_LOG_BYTES = 64 << 20
#: The agent's final message kept in the report is capped.
MAX_MESSAGE_CHARS = 8000

_BASE = TypeAdapter(Base)


def sandbox_name(task_id: str) -> str:
    """The sandbox of a task is named after it (the id is already validated)."""
    return f"agentbox-task-{task_id}"


class _TaskLog:
    """Timestamped lines in ``logs/launcher.log`` (for ``agentbox logs``); each is also the
    task's current ``phase`` in the store (for live progress)."""

    def __init__(self, paths: TaskPaths, store: Store) -> None:
        self.path = paths.log_dir / "launcher.log"
        self.store = store
        self.task_id = paths.task_id

    def __call__(self, msg: str) -> None:
        with contextlib.suppress(OSError), self.path.open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
        with contextlib.suppress(AgentboxError, sqlite3.Error):
            self.store.update(self.task_id, phase=msg[:200])


def _share_shadow(paths: TaskPaths) -> None:
    """Let the share group read this task's shadow git dir, and nothing else of the task.

    Used for ``publish=False`` tasks: the unprivileged MCP server fetches the result
    branch itself, from the trusted shadow dir. The task dir becomes group-traversable
    (not listable); the shadow dir (ours, never the agent's) group-readable. Links are
    never followed.
    """
    gid = _share_gid()
    if gid is None:
        return
    if not paths.data_dir.stat().st_mode & 0o011:
        os.chown(paths.data_dir, -1, gid, follow_symlinks=False)
        paths.data_dir.chmod(paths.data_dir.stat().st_mode | 0o010)
    os.chown(paths.root, -1, gid, follow_symlinks=False)
    paths.root.chmod(0o710)
    for top, dirs, files in os.walk(paths.shadow_git, followlinks=False):
        for name in [*dirs, *files]:
            p = Path(top, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            os.chown(p, -1, gid, follow_symlinks=False)
            extra = 0o050 if stat.S_ISDIR(st.st_mode) else 0o040
            p.chmod(stat.S_IMODE(st.st_mode) | extra)
    os.chown(paths.shadow_git, -1, gid, follow_symlinks=False)
    paths.shadow_git.chmod(stat.S_IMODE(paths.shadow_git.stat().st_mode) | 0o050)


def _repo_at_use(settings: Settings, row: TaskRow) -> Path:
    """The validated (resolved) repo path must still resolve to itself, inside the root."""
    real = check_inside(settings.repos_root, Path(row.repo), what="repo")
    if real != Path(row.repo):
        raise PathRefused(
            "the repo path now resolves elsewhere (a link was swapped in)", path=row.repo
        )
    return real


#: The unprivileged MCP server's group: it may traverse to a task's shadow git dir.
SHARE_GROUP = "agentbox"


def _share_gid() -> int | None:
    try:
        return grp.getgrnam(SHARE_GROUP).gr_gid
    except KeyError:
        return None


def _make_task_dir(paths: TaskPaths) -> None:
    tasks = paths.data_dir / "tasks"
    # 0710: the share group may pass through (never list) to a shared task's shadow dir.
    ensure_private_dir(tasks, 0o710 if _share_gid() is not None else 0o700)
    if (gid := _share_gid()) is not None:
        os.chown(tasks, -1, gid, follow_symlinks=False)
    try:
        paths.root.mkdir(mode=0o700)
    except FileExistsError as exc:
        raise PathRefused(
            "the task dir already exists: not one this task made", path=paths.root
        ) from exc
    paths.log_dir.mkdir(mode=0o700)


def _let_gofer_through(paths: TaskPaths, gofer_uid: int, tlog: _TaskLog) -> None:
    """Let gVisor's gofer (host uid ``subid_base``) search the tasks dir and this task's.

    It opens the workspace and gateway dir (bind-mount sources) as that uid, which is
    neither owner nor group of these private dirs: a named-user ACL entry gives it
    ``--x`` there and nobody else anything (``o+x`` would open them to every user).
    """
    for d in (paths.data_dir / "tasks", paths.root):
        try:
            grant_search(d, gofer_uid)
        except OSError as exc:
            # The backend's own check then names the dir and the fix.
            tlog(f"cannot give runsc's gofer (uid {gofer_uid}) search on {d}: {exc}")


def _write_token(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


def _check_spec(
    spec: SandboxSpec,
    box: Boxfile,
    paths: TaskPaths,
    settings: Settings,
    *,
    ours: tuple[BindMount, ...] = (),
    our_env: frozenset[str] = frozenset(),
) -> None:
    """The final spec mounts exactly the workspace, the gateway dir, declared mounts and
    ``ours`` (the frozen environment's overlay dirs, the egress CA bundle)."""
    if spec.workspace != paths.workspace or spec.gateway_dir != paths.gateway_dir:
        raise PolicyRefused("the sandbox spec does not mount this task's own workspace and gateway")
    declared = {(m.source.resolve(), m.target) for m in box.check_mounts(settings)}
    for m in spec.mounts:
        if m in ours:
            continue
        if (m.source.resolve(), m.target) not in declared or not m.read_only:
            raise PolicyRefused(f"undeclared or writable mount in the sandbox spec: {m.source}")
    allowed = set(box.env.allow) | set(box.env.set) | our_env
    check_env(spec.env, allowed)


def kill_gateway(gw: Owner) -> None:
    """Kill a gateway process group if it is still that very process."""
    from agentbox.launcher._watchdog import kill_gateway as _kill

    _kill(gw.pid, gw.start)


def data_label(settings: Settings) -> str:
    """A label value naming this data dir: launchers of other data dirs leave our sandboxes be."""
    return hashlib.sha256(str(settings.data_dir).encode()).hexdigest()[:16]


def list_task_sandboxes(settings: Settings) -> list[str]:
    """Names of the podman containers of tasks of this data dir."""
    argv = ["podman", "ps", "-a", "--filter", f"label={SANDBOX_LABEL}",
            "--filter", f"label={DATA_LABEL}={data_label(settings)}",
            "--format", "{{.Names}}"]  # fmt: skip
    try:
        res = _proc.run(argv, timeout=60, check=False)
    except AgentboxError:
        return []
    return [n for n in res.stdout.split() if n.startswith("agentbox-task-")]


def list_task_gateways(settings: Settings) -> list[tuple[str, Owner]]:
    """Gateway processes serving a task socket of this data dir: (task id, process)."""
    prefix = f"unix:{settings.data_dir / 'tasks'}/"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmd = proc.info.get("cmdline") or []
        # ``python -m agentbox gateway …`` or ``python -m agentbox.gateway …``: what
        # names it is a --listen on a socket under this data dir's task dirs.
        if "--listen" not in cmd or not any(a.endswith("gateway") for a in cmd[:4]):
            continue
        i = cmd.index("--listen")
        listen = cmd[i + 1] if i + 1 < len(cmd) else ""
        if not listen.startswith(prefix):
            continue
        task_id = listen[len(prefix) :].split("/", 1)[0]
        found.append((task_id, Owner(proc.info["pid"], proc.info["create_time"] or 0.0)))
    return found


def _final_message(stdout_log: Path) -> str:
    """The agent's last message from Claude Code's stream-json ``result`` event (report only)."""
    try:
        with stdout_log.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            tail = fh.read()
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("type") == "result":
            msg = ev.get("result")
            return msg[:MAX_MESSAGE_CHARS] if isinstance(msg, str) else ""
    return ""


def read_diff(paths: TaskPaths) -> tuple[str, bool]:
    """The saved diff of a result and whether it was truncated."""
    try:
        data = (paths.root / "result.diff").read_bytes()
    except OSError:
        return "", False
    truncated = (paths.root / "result.diff.truncated").exists()
    return data.decode(errors="replace"), truncated


def _save_base(paths: TaskPaths, base: Base) -> None:
    (paths.root / "base.json").write_bytes(_BASE.dump_json(base))


def _load_base(paths: TaskPaths) -> Base | None:
    try:
        return _BASE.validate_json((paths.root / "base.json").read_bytes())
    except (OSError, ValueError):
        return None


def _tokens(paths: TaskPaths) -> tuple[TokenUsage, dict[str, Any]]:
    try:
        u = read_usage(paths.usage_file)
    except AgentboxError:
        return TokenUsage(), {}
    t = TokenUsage(input=u.input, output=u.output, cache_creation=u.cache_creation,
                   cache_read=u.cache_read)  # fmt: skip
    extra = {"budget": u.budget, "weighted_total": u.weighted_total, "exhausted": u.exhausted,
             "requests": u.requests, "refusals": dict(u.refusals),
             "clamped": u.clamped}  # fmt: skip
    return t, extra


def _collect_and_finish(
    settings: Settings,
    store: Store,
    row: TaskRow,
    paths: TaskPaths,
    *,
    status: str,
    error: str | None,
    exit_code: int | None,
    tlog: _TaskLog,
    agent_ran: bool = True,
) -> None:
    """Collect whatever the workspace holds, publish it, write the report, mark the task.

    ``agent_ran`` False (it failed before the agent started): an untouched workspace is
    not reported as "no changes" (``changed`` stays None) but by what failed.
    """
    store.update(row.id, expect={"running", "collecting"}, status="collecting")
    tokens, usage_extra = _tokens(paths)
    refusals = usage_extra.get("refusals") or {}
    base = _load_base(paths)
    message = _final_message(paths.log_dir / "agent.jsonl")
    report = Report(
        task_id=row.id,
        status=status,
        exit_code=exit_code,
        model=row.model,
        tokens=tokens,
        budget=row.budget,
        base_commit=base.base_commit if base is not None else None,
        final_message=message or None,
        refused=[f"gateway refused {n} request(s): {why}" for why, n in refusals.items()],
        **transcript_summary(paths.log_dir / "agent.jsonl"),  # tools_run, last_test_command
    )
    commit = ""
    branch = ""
    changed: bool | None = None
    diff, truncated = "", False
    if base is None:
        error = error or "nothing to collect: the workspace was never prepared"
    else:
        tlog("collecting the workspace")
        try:
            collected = collect(
                paths.workspace,
                paths.shadow_git,
                paths.base_index,
                base,
                task_id=row.id,
                message=_commit_message(row, status),
            )
            report.add_collected(collected)
            commit, diff, truncated = collected.commit, collected.diff, collected.diff_truncated
            changed = collected.changed
            report.branch = None
            if not changed and not agent_ran:
                changed = None  # nothing ran to change anything: the error says why
            elif not changed:
                # Nothing to review: no commit, so nothing is published into the user's repo.
                # The agent ran (a failure before it started is said by its error, above),
                # so "no changes" is true of a finished or interrupted task; a task the
                # gateway stopped for budget is said by that error, never "no changes".
                tlog("nothing changed: no branch" if _budget_stopped(paths, status) else NO_CHANGES)
            elif not row.publish:
                _share_shadow(paths)
            else:
                _repo_at_use(settings, row)
                try:
                    branch = publish(
                        paths.shadow_git,
                        Path(row.repo),
                        task_id=row.id,
                        commit=commit,
                        record=paths.root / "published.json",
                        root=settings.repos_root,
                    )
                    tlog(f"published {branch}")
                except PublishRefused as exc:
                    # The user's ref is left alone and the result is kept: the task
                    # did its work; `agentbox publish ID --branch NAME` publishes it.
                    tlog(f"not published: {exc}")
                    report.notes.append(Skipped(path=branch_name(row.id), reason=str(exc)))
        except AgentboxError as exc:
            tlog(f"collection failed: {exc}")
            log.error("collection failed", task_id=row.id, error=str(exc))
            status = "failed"
            error = f"collection failed: {exc}"
            changed = None
    finished = time.time()
    started = row.started_at or row.created_at
    report.status = status
    report.error = error
    report.branch = branch or None
    report.changed = changed
    report.duration_s = round(finished - started, 3)
    data = report.model_dump(mode="json")
    data["usage"] = usage_extra
    data["agent_ran"] = agent_ran
    data["deadline_s"] = row.deadline
    data["repo"] = row.repo
    data.update(env_report_fields(paths.root, paths.log_dir))
    tmp = paths.report_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(paths.report_file)
    (paths.root / "result.diff").write_text(diff)
    if truncated:
        (paths.root / "result.diff.truncated").touch()
    store.finish(
        row.id,
        status,
        finished_at=finished,
        exit_code=exit_code,
        tokens=tokens,
        branch=branch or None,
        commit_id=commit or None,
        changed=None if changed is None else int(changed),
        error=error,
    )
    tlog(f"finished: {status}" + (f" ({error})" if error else ""))


#: A commit subject's length, as git tools show it (``git log --oneline``, GitHub).
SUBJECT_CHARS = 72


def commit_subject(task_id: str, task: str) -> str:
    """``agentbox <id>: <summary>``: the task's first line, cut at a word, within 72 chars."""
    lines = [ln.strip() for ln in task.strip().splitlines() if ln.strip()]
    first = " ".join(lines[0].split()) if lines else "task"
    head = f"agentbox {task_id}: "
    room = max(SUBJECT_CHARS - len(head), 10)
    if len(first) > room:
        cut = first[: room - 1]
        if " " in cut[room // 2 :]:
            cut = cut[: cut.rindex(" ")]  # never mid-word when a space is near the end
        first = cut.rstrip(" ,.;:-") + "…"
    return head + first


def _commit_message(row: TaskRow, status: str) -> str:
    """A short subject line; the whole task text in the body."""
    subject = commit_subject(row.id, row.task)
    return f"{subject}\n\n{row.task.strip()}\n\nstatus: {status}\nmodel: {row.model}\n"


def run_task(settings: Settings, store: Store, task_id: str, cancel: threading.Event) -> None:
    """Run one queued task to a terminal state (called on a worker thread)."""
    row = store.get(task_id)
    if row.status != "queued":
        return
    if row.cancel_requested or cancel.is_set():
        store.finish(task_id, "cancelled", error="cancelled before it started")
        return
    paths = TaskPaths(settings.data_dir, task_id)
    _make_task_dir(paths)
    tlog = _TaskLog(paths, store)
    box = Boxfile.model_validate_json(row.boxfile or "{}")
    gofer_uid = get_backend(box.backend, settings).bind_source_uid(box.runtime)
    if gofer_uid is not None:
        _let_gofer_through(paths, gofer_uid, tlog)
    # The gateway starts (a Python process: about a second) while the workspace is
    # copied; neither needs the other.
    token = _write_token(paths.root / "token")
    ensure_private_dir(paths.gateway_dir, 0o755)
    tlog(f"starting the gateway (model {row.model}, budget {row.budget})")
    starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"gw-{task_id}")
    gateway_future = starter.submit(
        spawn_gateway,
        socket_path=paths.gateway_socket,
        token_file=paths.root / "token",
        model=row.model,
        budget=row.budget,
        usage_file=paths.usage_file,
        settings=settings,
        log_file=paths.log_dir / "gateway.log",
        # Never root: a dedicated uid, no capabilities, no_new_privs, seccomp (issue 11.4).
        run_as=gateway_identity(settings),
    )
    starter.shutdown(wait=False)
    tlog(f"preparing the workspace from {row.repo}")
    try:
        # Checked again at use: the repos root belongs to a user who may have
        # swapped a path component for a link since the request was validated.
        _repo_at_use(settings, row)
        uid = settings.sandbox_host_uid
        # Opened once beneath the repos root, no link followed; the copy reads that
        # descriptor only (a link swapped in after the check above redirects nothing).
        base = prepare(
            Path(row.repo),
            paths.workspace,
            paths.shadow_git,
            paths.base_index,
            include_uncommitted=row.include_uncommitted,
            owner=(uid, uid),
            root=settings.repos_root,
        )
        _save_base(paths, base)
        give_to_sandbox(paths.workspace, settings.sandbox_host_uid)
        check_owner(paths.workspace, settings.sandbox_host_uid)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            gateway_future.result().stop(grace=1.0)
        if not isinstance(exc, AgentboxError):
            raise
        tlog(f"prepare failed: {exc}")
        store.finish(task_id, "failed", error=f"preparing the workspace failed: {exc}")
        return
    plan = None
    if box.setup is not None:
        plan = _setup_phase(settings, store, task_id, paths, box, cancel, tlog, gateway_future)
        if plan is None:
            return
    _run_sandbox(
        settings, store, store.get(task_id), paths, box, cancel, tlog, token, gateway_future, plan
    )


def _setup_phase(
    settings: Settings,
    store: Store,
    task_id: str,
    paths: TaskPaths,
    box: Boxfile,
    cancel: threading.Event,
    tlog: _TaskLog,
    gateway_future: concurrent.futures.Future[GatewayHandle],
) -> EnvPlan | None:
    """Run (or reuse) the task's ``[setup]``; None when it failed and the task is finished."""

    def cancelled() -> bool:
        if cancel.is_set():
            return True
        with contextlib.suppress(AgentboxError):
            return store.get(task_id).cancel_requested
        return False

    error = None
    plan = None
    try:
        plan = prepare_env(
            settings,
            box,
            get_backend(box.backend, settings),
            task_id=task_id,
            task_root=paths.root,
            workspace=paths.workspace,
            log_dir=paths.log_dir,
            labels={SANDBOX_LABEL: task_id, DATA_LABEL: data_label(settings)},
            proxy_identity=gateway_identity(settings),
            cancelled=cancelled,
            tlog=tlog,
        )
        save_setup_report(paths.root, plan.report)
        if plan.failed:
            r = plan.report
            last = r.output_tail.strip().splitlines()[-1:] or [""]
            why = "deadline" if r.timed_out else f"exit {r.exit_code}"
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
    with contextlib.suppress(BaseException):
        gateway_future.result().stop(grace=1.0)
    base = _load_base(paths)
    report = Report(
        task_id=task_id,
        status="cancelled" if error.startswith("cancelled") else "failed",
        model=store.get(task_id).model,
        base_commit=base.base_commit if base is not None else None,
        error=error,
    )
    data = report.model_dump(mode="json")
    data.update(env_report_fields(paths.root, paths.log_dir))
    paths.report_file.write_text(json.dumps(data, indent=2, default=str))
    store.finish(task_id, report.status, error=error)
    return None


def _run_sandbox(
    settings: Settings,
    store: Store,
    row: TaskRow,
    paths: TaskPaths,
    box: Boxfile,
    cancel: threading.Event,
    tlog: _TaskLog,
    token: str,
    gateway_future: concurrent.futures.Future[GatewayHandle],
    plan: EnvPlan | None = None,
) -> None:
    task_id = row.id
    gateway = None
    watchdog = None
    egress: Egress | None = None
    done = threading.Event()
    status, error, exit_code = "failed", None, None
    agent_ran = False
    try:
        gateway = gateway_future.result()
        gw_owner = Owner.of(gateway.pid)
        # The relay inside the sandbox connects as the sandbox uid.
        host_uid = settings.sandbox_host_uid
        os.chown(paths.gateway_socket, host_uid, host_uid, follow_symlinks=False)
        store.update(
            task_id,
            gateway_pid=gateway.pid,
            gateway_start=gw_owner.start if gw_owner else None,
        )
        backend = get_backend(box.backend, settings)
        ours = plan.mounts if plan is not None else ()
        if box.egress_allow:
            # The agent phase reaches only the hosts [network] allow names; without it
            # there is no proxy and no socket in the sandbox at all.
            policy = EgressPolicy.for_phase(settings, allow=box.egress_allow)
            egress = start_egress(
                settings,
                policy,
                paths.gateway_dir,
                paths.log_dir / "egress-agent.jsonl",
                gateway_identity(settings),
            )
            ours = (*ours, egress.mount)
            tlog(f"agent egress through the proxy: {', '.join(policy.hosts)}")
        spec = spec_from_boxfile(
            box,
            settings,
            name=sandbox_name(task_id),
            workspace=paths.workspace,
            gateway_dir=paths.gateway_dir,
            extra_env={**agent_env(token), **(egress.env if egress is not None else {})},
            labels={SANDBOX_LABEL: task_id, DATA_LABEL: data_label(settings)},
        ).replace(deadline=row.deadline)
        spec = spec.replace(mounts=(*spec.mounts, *ours))
        our_env = frozenset(egress.env) if egress is not None else frozenset()
        _check_spec(spec, box, paths, settings, ours=ours, our_env=our_env)
        argv = agent_argv(row.task)
        check_agent_argv(argv)
        check_owner(paths.workspace, settings.sandbox_host_uid)
        started = time.time()
        watchdog = spawn_watchdog(
            backend=box.backend,
            sandbox=spec.name,
            data_dir=settings.data_dir,
            at=started + row.deadline + WATCHDOG_GRACE,
            gateway_pid=gateway.pid,
            gateway_start=gw_owner.start if gw_owner else None,
            log_file=paths.log_dir / "watchdog.log",
        )
        if not store.update(
            task_id,
            expect={"queued"},
            status="running",
            started_at=started,
            sandbox=spec.name,
            watchdog_pid=watchdog.pid,
        ):
            raise _Cancelled
        monitor = threading.Thread(
            target=_monitor,
            args=(store, task_id, cancel, done, box.backend, spec.name, settings.data_dir),
            name=f"agentbox-monitor-{task_id}",
            daemon=True,
        )
        monitor.start()
        tlog(f"running claude in sandbox {spec.name} (deadline {row.deadline:g}s)")
        with (
            (paths.log_dir / "agent.jsonl").open("ab") as out,
            (paths.log_dir / "agent.stderr").open("ab") as err,
        ):
            res = backend.run(
                spec,
                egress_argv(argv) if egress is not None else argv,
                on_stdout=_sink(out),
                on_stderr=_sink(err),
            )
        exit_code = res.exit_code
        agent_ran = True
        elapsed = time.time() - started
        tlog(f"agent exited with code {exit_code} after {elapsed:.1f}s")
        if cancel.is_set() or store.get(task_id).cancel_requested:
            status, error = "cancelled", "cancelled while running; partial result collected"
        elif res.timed_out or elapsed >= row.deadline:
            status, error = "timed_out", f"killed at its deadline ({row.deadline:g}s)"
        elif exit_code == 0:
            status = "done"
        else:
            status, error = "failed", f"the agent exited with code {exit_code}"
    except _Cancelled:
        status, error = "cancelled", "cancelled before the sandbox started"
    except AgentboxError as exc:
        tlog(f"error: {exc}")
        # The task's failure, recorded in its row, report and log; not the launcher's
        # (a CLI run would print it raw on stderr above the report that says it).
        log.info("task failed", task_id=task_id, error=str(exc))
        status, error = "failed", str(exc)[:4000]
    finally:
        done.set()
        if watchdog is not None:
            stop_watchdog(watchdog.pid)
        if gateway is not None:
            gateway.stop(grace=3.0)
        if egress is not None:
            egress.proxy.stop(grace=2.0)
        if plan is not None:
            plan.release()
    with contextlib.suppress(AgentboxError):
        why = budget_error(read_usage(paths.usage_file))
        if why is not None and status in ("failed", "done"):
            # Claude Code reports a 403 as "Failed to authenticate": say what it was.
            status, error = "failed", why
    if not agent_ran:
        # A failure before the agent started (no image, a sandbox that would not start):
        # its output log is empty. One that ran and then failed to tear down wrote there.
        with contextlib.suppress(OSError):
            agent_ran = (paths.log_dir / "agent.jsonl").stat().st_size > 0
    _collect_and_finish(
        settings,
        store,
        store.get(task_id),
        paths,
        status=status,
        error=error,
        exit_code=exit_code,
        tlog=tlog,
        agent_ran=agent_ran,
    )


def _budget_stopped(paths: TaskPaths, status: str) -> bool:
    """Whether a task that did not finish was stopped by the gateway for budget."""
    if status == "done":
        return False
    try:
        return budget_error(read_usage(paths.usage_file)) is not None
    except AgentboxError:  # no usage file (a reconciled task): not a budget stop
        return False


def budget_error(usage: Usage) -> str | None:
    """The task's error when the gateway refused for budget ("budget exhausted after N of M
    tokens"), else None."""
    refused = sum(usage.refusals.get(k, 0) for k in ("budget_exhausted", "over_budget"))
    if not usage.exhausted and not refused:
        return None
    return (
        f"budget exhausted after {usage.weighted_total:,.0f} of {usage.budget:,} tokens "
        f"(the gateway refused {refused} request(s) for budget)"
    )


class _Cancelled(Exception):
    pass


def _sink(fh: BinaryIO, limit: int = MAX_LOG_BYTES) -> Callable[[bytes], None]:
    """A callback writing the agent's output to ``fh``, up to ``limit`` bytes.

    The agent controls what it prints; past the cap the rest is dropped (once
    noted in the file) so a task cannot fill the host's disk through its log.
    """
    written = 0

    def write(chunk: bytes) -> None:
        nonlocal written
        if written >= limit:
            return
        room = limit - written
        fh.write(chunk[:room])
        written += min(len(chunk), room)
        if written >= limit:
            fh.write(b"\n[agentbox: output past this point dropped: log cap reached]\n")
        fh.flush()

    return write


def _monitor(
    store: Store,
    task_id: str,
    cancel: threading.Event,
    done: threading.Event,
    backend: str,
    sandbox: str,
    data_dir: Path,
) -> None:
    """Turn a cancel (this process's event, or another process's flag) into a kill."""
    while not done.wait(0.5):
        flagged = cancel.is_set()
        if not flagged:
            with contextlib.suppress(AgentboxError):
                flagged = store.get(task_id).cancel_requested
        if flagged:
            kill_sandbox(backend, sandbox, data_dir)
            return


def finish_orphan(settings: Settings, store: Store, row: TaskRow) -> None:
    """Collect and mark a task whose launcher died (its sandbox and gateway already removed)."""
    paths = TaskPaths(settings.data_dir, row.id)
    if not paths.root.is_dir():
        store.finish(row.id, "failed", error="the launcher stopped before the task dir existed")
        return
    tlog = _TaskLog(paths, store)
    tlog("a restarted launcher reconciles this task: its launcher died")
    release_task_env(paths.root)
    started = row.started_at or row.created_at
    if row.cancel_requested:
        status, error = "cancelled", "cancelled; its launcher died; partial result collected"
    elif time.time() - started >= row.deadline:
        status, error = "timed_out", "deadline passed while its launcher was down"
    else:
        status, error = "failed", "interrupted: its launcher died; partial result collected"
    _collect_and_finish(
        settings, store, row, paths, status=status, error=error, exit_code=None, tlog=tlog
    )
