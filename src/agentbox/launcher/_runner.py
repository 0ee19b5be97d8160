"""One task, from a queued row to a sandbox that runs the agent, then to its end.

The order matters and each step is refused or recorded before the next:

1. the task dir is made fresh (an existing one is refused: the launcher only
   hands out workspaces it made), the repo copied at its base commit by
   :func:`agentbox.collect.prepare`, and the workspace given to the sandbox uid
   without following links, then checked to be owned by it (stage
   ``preparing``: nothing of the agent ran yet, so a launcher that dies here
   leaves a task the next one runs from scratch);
2. a fresh one-time token is written 0600 in the task dir (never mounted) and
   the task's own gateway started on a socket in ``gw/``, the only directory
   mounted besides the workspace; it stops by itself at the task's deadline plus
   a grace, launcher or not;
3. the sandbox runs ``claude -p …`` (the argv and environment checked against
   policy) under the backend's own deadline. On a backend that detaches
   (podman, docker, qemu), the sandbox is *launched* (stage ``launched``, everything a new
   launcher needs to re-adopt it recorded first) and *followed*
   (:mod:`agentbox.launcher._follow`): nothing of ours holds it, so the launcher
   may die and a new one re-adopts it. Other backends run it attached, with a
   watchdog process as the second line;
4. :func:`agentbox.launcher._finish.collect_and_finish` collects, publishes and
   marks the task.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agentbox.backends import exit_marker, get_backend
from agentbox.backends.base import Backend, BindMount, SandboxSpec
from agentbox.boxfile import Boxfile
from agentbox.collect import prepare_unsettled
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths
from agentbox.egress import EgressPolicy
from agentbox.env import (
    Egress,
    EnvPlan,
    brokered_rules,
    egress_argv,
    rule_secrets,
    sandbox_config,
    start_egress,
)
from agentbox.errors import AgentboxError, GatewayError, PathRefused, PolicyRefused
from agentbox.gateway import GatewayHandle, gateway_identity, spawn_gateway
from agentbox.launcher import _session
from agentbox.launcher._agent import agent_argv, agent_env, check_agent_argv, check_env, model_id
from agentbox.launcher._context import TaskContext
from agentbox.launcher._finish import (
    NEVER_STARTED,
    cancelled_early,
    repo_at_use,
    save_base,
    settle,
    share_gid,
    stop_gateway,
)
from agentbox.launcher._follow import Ended, ended, follow_sandbox
from agentbox.launcher._follow import monitor as _monitor
from agentbox.launcher._follow import sink as _sink
from agentbox.launcher._groupbudget import link_for_gateway as link_group_budget
from agentbox.launcher._names import (
    sandbox_labels,
    sandbox_name,
)
from agentbox.launcher._setup import setup_phase
from agentbox.launcher._store import Owner, Store, TaskRow
from agentbox.launcher._watchdog import kill_sandbox, spawn_watchdog, stop_watchdog
from agentbox.launcher._workspace import (
    check_owner,
    ensure_private_dir,
    give_to_sandbox,
    let_gofer_through,
    write_token,
)
from agentbox.linux.wake import Wake
from agentbox.observe.resources import watch as watch_resources
from agentbox.sandbox import image_of, spec_from_boxfile

log = get_logger(__name__)

#: Seconds past the deadline after which the watchdog process removes the sandbox.
WATCHDOG_GRACE = 30.0
#: Seconds past the deadline after which a task's gateway stops by itself (``--exit-at``).
GATEWAY_GRACE = 120.0
#: Added to a gateway's exit time when the task has a ``[setup]`` phase to run first.
SETUP_ALLOWANCE = 3600.0


def _make_task_dir(paths: TaskPaths) -> None:
    tasks = paths.data_dir / "tasks"
    # 0710: the share group may pass through (never list) to a shared task's shadow dir.
    ensure_private_dir(tasks, 0o710 if share_gid() is not None else 0o700)
    if (gid := share_gid()) is not None:
        os.chown(tasks, -1, gid, follow_symlinks=False)
    try:
        paths.root.mkdir(mode=0o700)
    except FileExistsError as exc:
        raise PathRefused(
            "the task dir already exists: not one this task made", path=paths.root
        ) from exc
    paths.log_dir.mkdir(mode=0o700)


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


def run_task(settings: Settings, store: Store, task_id: str, cancel: threading.Event) -> None:
    """Run one queued task to a terminal state (called on a worker thread, within the
    task's uid slot: :func:`agentbox.launcher._uidslot.run_in_slot`)."""
    row = store.get(task_id)
    if row.status != "queued":
        return
    if row.cancel_requested or cancel.is_set():
        store.finish(task_id, "cancelled", error=NEVER_STARTED)
        return
    ctx = TaskContext.of(settings, store, task_id, cancel)
    paths, tlog = ctx.paths, ctx.tlog
    # Taken: from here a cancel goes through this worker (see _cancel); until the sandbox
    # runs, a launcher that dies leaves a task to run again. Lost: cancelled (or taken).
    if not store.update(task_id, expect={"queued"}, unstaged=True, stage="preparing"):
        return
    _make_task_dir(paths)
    box = Boxfile.model_validate_json(row.boxfile or "{}")
    backend = get_backend(box.backend, settings)
    gofer_uid = backend.bind_source_uid(box.runtime)
    if gofer_uid is not None:
        let_gofer_through(paths, gofer_uid, tlog)
    # The gateway starts (a Python process: 0.5-1 s to serve) while the workspace is
    # copied and the sandbox started; none needs the other until the agent's first
    # request, which waits in the gateway socket's backlog (bound before the spawn
    # returns). The gateway is known ready before the agent is followed.
    if cancelled_early(ctx):
        return
    token = write_token(paths.root / "token")
    ensure_private_dir(paths.gateway_dir, 0o755)
    dollars = f", budget ${box.budget_usd:g}" if box.budget_usd is not None else ""
    shared = " shared by the group" if link_group_budget(settings, paths, row.group_id) else ""
    tlog(f"starting the gateway (model {row.model}, budget {row.budget}{dollars}{shared})")
    starter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"gw-{task_id}")
    gateway_future = starter.submit(
        spawn_gateway,
        socket_path=paths.gateway_socket,
        token_file=paths.root / "token",
        model=row.model,
        budget=row.budget,
        budget_usd=box.budget_usd,
        usage_file=paths.usage_file,
        settings=settings,
        log_file=paths.log_dir / "gateway.log",
        # Never root: a dedicated uid, no capabilities, no_new_privs, seccomp.
        run_as=gateway_identity(settings),
        # It outlives a launcher that dies (a detached task is re-adopted), not the task.
        exit_at=time.time()
        + row.deadline
        + GATEWAY_GRACE
        + (SETUP_ALLOWANCE if box.setup is not None else 0.0),
        wait=False,
    )
    # And what the launch will look up (podman: the image), beside the workspace copy.
    starter.submit(_warm, backend, image_of(box, settings), task_id)
    starter.shutdown(wait=False)
    tlog(f"preparing the workspace from {row.repo}")
    try:
        # Checked again at use: the repos root belongs to a user who may have
        # swapped a path component for a link since the request was validated.
        repo_at_use(settings, row)
        uid = settings.sandbox_host_uid
        # Opened once beneath the repos root, no link followed; the copy reads that
        # descriptor only (a link swapped in after the check above redirects nothing).
        base, settle_workspace = prepare_unsettled(
            Path(row.repo),
            paths.workspace,
            paths.shadow_git,
            paths.base_index,
            commit=_session.base_commit(settings, task_id),  # HEAD, or a resumed task's result
            include_uncommitted=row.include_uncommitted,
            owner=(uid, uid),
            root=settings.repos_root,
            cache=settings.data_dir / "cache" / "bases",  # git's work once per repo commit
        )
        save_base(paths, base)
        if base.untracked_note:
            tlog(base.untracked_note)
        _session.seed(settings, paths)  # a resumed task: the previous one, for the agent
        give_to_sandbox(paths.workspace, settings.sandbox_host_uid)
        check_owner(paths.workspace, settings.sandbox_host_uid)
    except BaseException as exc:
        stop_gateway(gateway_future)
        if not isinstance(exc, AgentboxError):
            raise
        tlog(f"prepare failed: {exc}")
        store.finish(task_id, "failed", error=f"preparing the workspace failed: {exc}")
        return
    if cancelled_early(ctx, gateway_future):
        return
    plan = None
    if box.setup is not None:
        settle_workspace()  # before the setup's sandbox may write the workspace
        # Best-of-N: the attempts of a group set up one at a time, so the first builds
        # and freezes the environment and the others reuse it (the key is the same).
        with _group_lock(row.group_id):
            plan = setup_phase(ctx, box, gateway_future)
        if plan is None:
            return
    _run_sandbox(ctx, store.get(task_id), box, token, gateway_future, plan, settle_workspace)


_GROUP_LOCKS: dict[str, threading.Lock] = {}
_GROUP_LOCKS_GUARD = threading.Lock()


def _group_lock(group: str | None) -> contextlib.AbstractContextManager[object]:
    """The lock of a best-of-N group's ``[setup]`` in this launcher (none for a lone task)."""
    if group is None:
        return contextlib.nullcontext()
    with _GROUP_LOCKS_GUARD:
        return _GROUP_LOCKS.setdefault(group, threading.Lock())


def _warm(backend: Backend, image: str, task_id: str) -> None:
    """:meth:`Backend.warm`, which never fails the task (the launch says what is wrong)."""
    try:
        backend.warm(image)
    except Exception as exc:  # housekeeping ahead of the launch, never the task's failure
        log.debug("warm-up failed", task_id=task_id, image=image, error=str(exc)[-300:])


def _run_sandbox(
    ctx: TaskContext,
    row: TaskRow,
    box: Boxfile,
    token: str,
    gateway_future: concurrent.futures.Future[GatewayHandle],
    plan: EnvPlan | None = None,
    settle_workspace: Callable[[], None] = lambda: None,
) -> None:
    """Run the agent's sandbox on the prepared workspace, then settle the task.

    ``settle_workspace``: prepare's wait for the timestamp clock (see
    :func:`agentbox.collect.prepare_unsettled`), called just before the sandbox starts,
    after the work here that would otherwise follow it."""
    settings, store, paths, tlog = ctx.settings, ctx.store, ctx.paths, ctx.tlog
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
        # [git] fetch: the repo's remote, upload-pack only, the user's credential brokered.
        brokered, agent_rules = brokered_rules(
            settings, box, phase="agent", uid=row.caller_uid, repo=Path(row.repo)
        )
        if box.egress_allow or agent_rules:
            # The agent phase reaches only the hosts [network] allow and its rules name;
            # without them there is no proxy and no socket in the sandbox at all.
            policy = EgressPolicy.for_phase(
                settings, allow=box.egress_allow, rules=agent_rules, phase="agent"
            )
            egress = start_egress(
                settings,
                policy,
                paths.gateway_dir,
                paths.log_dir / "egress-agent.jsonl",
                gateway_identity(settings),
                secret_values=rule_secrets(
                    settings, policy.network_rules, row.caller_uid, known=brokered.values
                ),
            )
            egress.env.update(sandbox_config(settings, egress, brokered))
            for note in brokered.notes:
                tlog(note)
            ours = (*ours, egress.mount)
            tlog(f"agent egress through the proxy: {', '.join(policy.hosts)}")
        spec = spec_from_boxfile(
            box,
            settings,
            name=sandbox_name(task_id),
            workspace=paths.workspace,
            gateway_dir=paths.gateway_dir,
            extra_env={
                **agent_env(token, model_id(settings, row.model), attempt=row.attempt),
                **(egress.env if egress is not None else {}),
            },
            labels=sandbox_labels(settings, task_id),
        ).replace(deadline=row.deadline)
        spec = spec.replace(mounts=(*spec.mounts, *ours))
        our_env = frozenset(egress.env) if egress is not None else frozenset()
        _check_spec(spec, box, paths, settings, ours=ours, our_env=our_env)
        argv = agent_argv(
            _session.agent_task(paths, row.task),
            resume=_session.resume_session(paths),
            env=spec.env,  # the launcher's variables, pinned over the workspace's settings
        )
        check_agent_argv(argv)
        check_owner(paths.workspace, settings.sandbox_host_uid)
        settle_workspace()  # nothing but us wrote the workspace before this
        started = time.time()
        run_argv = egress_argv(argv) if egress is not None else argv
        # Detached where the backend can (podman): the launcher may die and a new one
        # re-adopts the task. Not with agent egress: its proxy is the launcher's child.
        if egress is None and backend.detaches(box.runtime):
            status, error, exit_code = _run_detached(
                ctx, row, box, backend, spec, run_argv, started, gateway
            )
            agent_ran = True
        else:
            watchdog = spawn_watchdog(
                backend=box.backend,
                sandbox=spec.name,
                data_dir=settings.data_dir,
                at=started + row.deadline + WATCHDOG_GRACE,
                gateway_pid=gateway.pid,
                gateway_start=gw_owner.start if gw_owner else None,
                log_file=paths.log_dir / "watchdog.log",
            )
            ran = store.update(
                task_id,
                expect={"queued"},
                status="running",
                started_at=started,
                sandbox=spec.name,
                watchdog_pid=watchdog.pid,
                stage="attached",
            )
            if not ran or ctx.cancelled():  # a cancel since the last step: no sandbox starts
                raise _Cancelled
            monitor = threading.Thread(
                target=_monitor,
                args=(ctx, done, box.backend, spec.name),
                name=f"agentbox-monitor-{task_id}",
                daemon=True,
            )
            monitor.start()
            gateway.wait_ready()  # attached: nothing to overlap with its start
            tlog(f"running claude in sandbox {spec.name} (deadline {row.deadline:g}s)")
            with (
                (paths.log_dir / "agent.jsonl").open("ab") as out,
                (paths.log_dir / "agent.stderr").open("ab") as err,
                watch_resources(paths.root, box.backend, spec.name, paths.workspace),
            ):
                res = backend.run(spec, run_argv, on_stdout=_sink(out), on_stderr=_sink(err))
            agent_ran = True
            elapsed = time.time() - started
            tlog(f"agent exited with code {res.exit_code} after {elapsed:.1f}s")
            status, error, exit_code = ended(
                ctx,
                exit_code=res.exit_code,
                timed_out=res.timed_out,
                deadline=row.deadline,
                past_deadline=elapsed >= row.deadline,
            )
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
            watchdog.poll()  # reaped just now: the Popen learns it (else a ResourceWarning)
        if gateway is not None:
            gateway.stop(grace=3.0)
        if egress is not None:
            egress.proxy.stop(grace=2.0)
        if plan is not None:
            plan.release()
    settle(ctx, (status, error, exit_code), agent_ran=agent_ran)


class _Cancelled(Exception):
    pass


class _StopAtEnd:
    """Stop the task's gateway as soon as its follower has recorded the sandbox's end
    (``marker``: written once every process of the sandbox is gone, before the disk is
    copied back and the sandbox removed), beside those steps instead of after them.

    :meth:`done` (the follow is over) gives up if the end was never seen, else waits for
    that stop to finish: the caller's own stop after it then finds the gateway gone and
    sends nothing (a second SIGTERM reaching a gateway past its graceful shutdown's
    handlers would kill it before it wrote its usage).
    """

    def __init__(self, gateway: GatewayHandle, marker: Path, task_id: str) -> None:
        self.gateway, self.marker, self.task_id = gateway, marker, task_id
        self._lock = threading.Lock()
        self._over = False
        self._claimed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"agentbox-gwstop-{task_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            with Wake(None, self.marker.parent) as wake:
                while True:
                    with self._lock:
                        if self._over:
                            return
                        if self.marker.exists():
                            self._claimed = True
                            break
                    wake.wait(0.5)  # the marker's rename into the log dir wakes it at once
            self.gateway.stop(grace=3.0)
        except Exception as exc:  # best effort: the caller stops the gateway anyway
            log.debug("early gateway stop failed", task_id=self.task_id, error=str(exc)[-300:])
        finally:
            self._stopped.set()

    def done(self) -> None:
        with self._lock:
            self._over = True
            claimed = self._claimed
        if claimed:
            self._stopped.wait()  # bounded: the stop's grace, then its kill


def _run_detached(
    ctx: TaskContext,
    row: TaskRow,
    box: Boxfile,
    backend: Backend,
    spec: SandboxSpec,
    argv: list[str],
    started: float,
    gateway: GatewayHandle,
) -> Ended:
    """Launch the agent's sandbox detached and follow it to its end (no watchdog: the
    runtime holds the deadline, the gateway its own exit time).

    The sandbox starts while the gateway may still be starting (both take most of a
    second); the gateway must be ready before the agent is followed. One that never
    gets ready fails the task: its sandbox is killed and followed to its end (its
    output and workspace collected as after any kill).
    """
    log_path = ctx.paths.log_dir / "sandbox.log"
    # Recorded before the launch: a launcher that dies right after it leaves a task
    # the next one re-adopts (what it checks: the name, these labels, the gateway).
    ran = ctx.store.update(
        row.id,
        expect={"queued"},
        status="running",
        started_at=started,
        sandbox=spec.name,
        stage="launched",
        runtime=box.runtime,
        labels=dict(spec.labels),
        sandbox_log=str(log_path),
        deadline_at=started + row.deadline,
    )
    if not ran or ctx.cancelled():  # a cancel since the last step: no sandbox starts
        raise _Cancelled
    ctx.tlog(f"running claude in sandbox {spec.name}, detached (deadline {row.deadline:g}s)")
    backend.launch(spec, argv, log=log_path)
    early_stop = _StopAtEnd(gateway, exit_marker(log_path), row.id)
    gateway_failed: GatewayError | None = None
    try:
        try:
            gateway.wait_ready()
        except GatewayError as exc:
            gateway_failed = exc
            ctx.tlog(f"the gateway did not start: {exc}; killing the sandbox")
            kill_sandbox(box.backend, spec.name, ctx.paths.data_dir)
        outcome = follow_sandbox(
            ctx,
            backend,
            box.backend,
            name=spec.name,
            deadline=row.deadline,
            deadline_at=started + row.deadline,
        )
    finally:
        early_stop.done()
    if gateway_failed is not None:
        return "failed", f"the task's gateway did not start: {gateway_failed}"[:4000], outcome[2]
    return outcome
