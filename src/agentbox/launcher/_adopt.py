"""Live restore: what a launcher does with the tasks of a launcher that died.

:meth:`agentbox.launcher.Launcher.reconcile` claims each non-terminal task whose
owner is gone (one claimer wins) and then, by where the task was:

* **queued or preparing** (nothing of the agent ran): :func:`requeue`. Whatever the
  dead launcher had started for it (its gateway, a setup sandbox, the partial task
  dir) is removed and the task waits again, in submission order, for this launcher;
* **running detached** (stage ``launched``): re-adopted when :func:`adopt_refusal`
  finds every recorded target to be the one recorded: the sandbox by name *and*
  labels (task id, data dir, labels version) under this data dir, the log path this
  task's, and the gateway, if it still runs, the same pid, start time and command
  line (a pid reused by another process is refused and never signalled), and a
  handshake version it knows (``gateway.json``: a newer one is refused). Then
  :func:`adopt` follows it to the end from the start of its log and collects and
  publishes as if nothing had happened; the transcript says who took over;
* **collecting** with its outcome recorded: collected again (collection and
  publishing are idempotent);
* anything else (an attached sandbox, a refused target): settled as before: its
  sandbox reaped, what the agent wrote collected, the task marked, and the reason
  logged in its transcript.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Collection

import psutil

from agentbox.backends import (
    get_backend,
    owned_sandboxes,
    reap_uid_slots,
    settle_dead_disks,
    sweep_pools,
)
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths
from agentbox.core.wait import wait_until
from agentbox.env import release_task_env, setup_sandbox_name
from agentbox.errors import AgentboxError, PathRefused, SandboxGone
from agentbox.gateway import HANDSHAKE_VERSION, read_handshake, read_usage
from agentbox.launcher._context import TaskContext
from agentbox.launcher._finish import (
    collect_and_finish,
    finish_orphan,
    recorded_outcome,
    settle,
)
from agentbox.launcher._follow import Ended, follow_sandbox
from agentbox.launcher._names import (
    DATA_LABEL,
    SANDBOX_LABEL,
    data_label,
    kill_gateway,
    list_task_gateways,
    sandbox_name,
)
from agentbox.launcher._retention import remove_tree
from agentbox.launcher._store import Owner, Store, TaskRow
from agentbox.launcher._watchdog import reap_sandbox, stop_watchdog

log = get_logger(__name__)


def gateway_refusal(gw: Owner | None, paths: TaskPaths) -> str | None:
    """None if ``gw`` runs and is this task's gateway; else why it is not (gone, or a
    pid now another process's: same pid, another start time or command line)."""
    if gw is None:
        return "no gateway was recorded"
    try:
        proc = psutil.Process(gw.pid)
        start, cmd, state = proc.create_time(), proc.cmdline(), proc.status()
    except psutil.Error:
        return f"its gateway (pid {gw.pid}) is gone"
    if state == psutil.STATUS_ZOMBIE:
        return f"its gateway (pid {gw.pid}) is gone"
    if abs(start - gw.start) > 0.01:
        return f"pid {gw.pid} is another process now (started {start:.2f}, not {gw.start:.2f})"
    i = cmd.index("--listen") if "--listen" in cmd else -1
    listen = cmd[i + 1] if 0 <= i < len(cmd) - 1 else ""
    if not any(a.endswith("gateway") for a in cmd[:4]) or listen != f"unix:{paths.gateway_socket}":
        return f"pid {gw.pid} is not this task's gateway (its command line differs)"
    return handshake_refusal(gw, paths)


def handshake_refusal(gw: Owner, paths: TaskPaths) -> str | None:
    """None if the gateway's handshake (``gateway.json`` in its state dir, see
    :mod:`agentbox.gateway._handshake`) is one this launcher speaks; a gateway that
    wrote none is not one whose files and signals it can vouch for."""
    state = paths.usage_file.with_name(paths.usage_file.name + ".d")
    try:
        hs = read_handshake(state if state.is_dir() else paths.usage_file.parent)
    except ValueError as exc:
        return f"its gateway's handshake is unreadable: {exc}"
    if hs is None:
        return "its gateway wrote no handshake (gateway.json)"
    if hs.pid != gw.pid:
        return f"its gateway's handshake names pid {hs.pid}, not {gw.pid}"
    if hs.version > HANDSHAKE_VERSION:
        return (
            f"its gateway speaks handshake version {hs.version}, newer than this "
            f"launcher's {HANDSHAKE_VERSION}"
        )
    return None


def _gateway_gone(why: str | None) -> bool:
    return why is not None and why.endswith("is gone")


def adopt_refusal(settings: Settings, row: TaskRow) -> str | None:
    """None when the running task ``row`` may be re-adopted; else why not."""
    paths = TaskPaths(settings.data_dir, row.id)
    if row.stage != "launched" or not row.backend or not row.sandbox:
        return "its sandbox ran attached to the launcher that died"
    if row.sandbox != sandbox_name(row.id):
        return f"the recorded sandbox {row.sandbox!r} is not this task's"
    labels = row.labels or {}
    if labels.get(SANDBOX_LABEL) != row.id or labels.get(DATA_LABEL) != data_label(settings):
        return "the recorded sandbox labels name another task or data dir"
    if row.sandbox_log != str(paths.log_dir / "sandbox.log"):
        return "the recorded sandbox log is not this task's"
    try:
        backend = get_backend(row.backend, settings)
        if not backend.detaches(row.runtime or "runc"):
            return f"the {row.backend} backend cannot re-attach to a sandbox"
        ended = _exit_record(paths)  # a follower that died after the end recorded it
        if not ended and not backend.adoptable(row.sandbox, labels=labels):
            return f"no sandbox {row.sandbox} with the recorded labels under this data dir"
    except AgentboxError as exc:
        return f"its sandbox cannot be checked: {exc}"
    why = gateway_refusal(row.gateway, paths)
    if why is not None and not _gateway_gone(why):
        return why  # a forged or reused pid: nothing of this task is trusted
    return None


def _exit_record(paths: TaskPaths) -> bool:
    """Whether a follower recorded the sandbox's end beside its log (it may be removed)."""
    log_path = paths.log_dir / "sandbox.log"
    return log_path.with_name(log_path.name + ".exit").is_file()


def never_started(settings: Settings, row: TaskRow) -> bool:
    """A task recorded ``launched`` whose agent never ran: its launcher died during the
    launch, before the sandbox started. No sandbox of ours by its name, no output, no
    end recorded, and its gateway served no request: it may run again from scratch
    (:func:`requeue`)."""
    paths = TaskPaths(settings.data_dir, row.id)
    if row.stage != "launched" or not row.backend or not row.sandbox or _exit_record(paths):
        return False
    try:
        if get_backend(row.backend, settings).adoptable(row.sandbox, labels={}):
            return False  # it exists: whatever it did, it is not run again
    except AgentboxError:
        return False
    try:
        if (paths.log_dir / "sandbox.log").stat().st_size > 0:
            return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        return read_usage(paths.usage_file).requests == 0
    except AgentboxError:
        return True  # no usage file: the gateway never even wrote its zeros


def stop_gateway(gw: Owner | None, paths: TaskPaths, *, grace: float = 3.0) -> None:
    """Stop an adopted task's gateway (TERM, so it writes its usage; KILL after ``grace``),
    only if it is still this task's very gateway."""
    if gw is None or gateway_refusal(gw, paths) is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(gw.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):  # past the grace: killed below
        wait_until(lambda: gateway_refusal(gw, paths) is not None, timeout=grace,
                   on_timeout=TimeoutError, interval=0.05)  # fmt: skip
    kill_gateway(gw)


def adopt(settings: Settings, store: Store, row: TaskRow, cancel: threading.Event) -> None:
    """Follow a re-adopted task's sandbox to its end, then collect and publish it."""
    ctx = TaskContext.of(settings, store, row.id, cancel)
    paths, tlog = ctx.paths, ctx.tlog
    store.update(row.id, adoptions=row.adoptions + 1)
    tlog(f"re-adopted by launcher pid {os.getpid()}: following sandbox {row.sandbox}")
    if (why := gateway_refusal(row.gateway, paths)) is not None:
        tlog(f"{why}: the agent can no longer reach the model")
    assert row.backend is not None and row.sandbox is not None  # adopt_refusal checked
    outcome: Ended
    try:
        outcome = follow_sandbox(
            ctx,
            get_backend(row.backend, settings),
            row.backend,
            name=row.sandbox,
            deadline=row.deadline,
            deadline_at=row.deadline_at or 0.0,
            adopted=True,
        )
    except SandboxGone as exc:
        outcome = ("failed", f"its sandbox vanished while re-adopted: {exc}", None)
    except AgentboxError as exc:
        tlog(f"error: {exc}")
        outcome = ("failed", str(exc)[:4000], None)
    finally:
        stop_gateway(row.gateway, paths)
        release_task_env(paths.root)
    settle(ctx, outcome, agent_ran=True)


def requeue(settings: Settings, store: Store, row: TaskRow) -> bool:
    """Undo what a dead launcher began for a task that never reached its agent (queued,
    preparing, or :func:`never_started`), and mark it queued again (True); False when
    its partial dir cannot be removed (settle it)."""
    paths = TaskPaths(settings.data_dir, row.id)
    for task_id, gw in list_task_gateways(settings):
        if task_id == row.id:
            kill_gateway(gw)
    if row.gateway is not None:
        kill_gateway(row.gateway)
    if row.sandbox and row.backend:
        reap_sandbox(row.backend, row.sandbox, settings.data_dir)
    release_task_env(paths.root)
    try:
        remove_tree(paths.root.parent, row.id)
    except (OSError, PathRefused) as exc:
        log.error("cannot discard a partial task dir", task_id=row.id, error=str(exc))
        return False
    log.warning("task of a dead launcher queued again", task_id=row.id)
    return store.update(
        row.id,
        expect={"queued", "running"},
        status="queued",
        started_at=None,
        phase="queued again: its launcher died before the agent started",
        stage=None,
        sandbox=None,
        gateway_pid=None,
        gateway_start=None,
        watchdog_pid=None,
    )


def settle_orphan(settings: Settings, store: Store, row: TaskRow, why: str | None) -> None:
    """Remove what is left of a claimed task, collect what the agent wrote, mark it."""
    log.warning("settling task whose launcher died", task_id=row.id, status=row.status,
                not_adopted=why)  # fmt: skip
    if row.watchdog_pid:
        stop_watchdog(row.watchdog_pid)
    if row.sandbox and row.backend:
        # Reap, not only kill: the backend saves what the agent wrote where it is
        # collected (a microVM's /data disk, qemu or firecracker, read in userspace
        # in a jail; a podman workspace disk copied back and unmounted), then removes
        # the sandbox. Usually the task's watchdog did it when the launcher died.
        reap_sandbox(row.backend, row.sandbox, settings.data_dir)
    if row.gateway is not None:
        kill_gateway(row.gateway)
    if row.status == "queued":
        store.finish(row.id, "failed", error="the launcher stopped before the task ran")
        return
    ctx = TaskContext.of(settings, store, row.id)
    outcome = recorded_outcome(row.outcome) if row.status == "collecting" else None
    if outcome is not None and ctx.paths.root.is_dir():
        # Caught collecting: the agent's end was recorded; collect (again) with it.
        ctx.tlog(f"collected again by launcher pid {os.getpid()}: its launcher died collecting")
        (status, error, code), ran = outcome
        collect_and_finish(ctx, store.get(row.id), status=status, error=error, exit_code=code,
                           agent_ran=ran)  # fmt: skip
        return
    if why is not None and ctx.paths.log_dir.is_dir():
        ctx.tlog(f"not re-adopted: {why}")
    finish_orphan(settings, store, store.get(row.id))


def take_over(
    settings: Settings, store: Store, me: Owner, *, adopt: bool = True
) -> tuple[list[str], list[str], list[TaskRow]]:
    """Claim and sort the tasks whose launcher died: (settled ids, ids to queue again,
    rows to follow); then remove orphan sandboxes and gateways.

    ``adopt=False`` (a foreground run): a task a launcher service would run again or
    re-adopt (queued; running detached and adoptable, or never started) is not
    claimed, and its sandbox and gateway are not orphans; only the rest is settled.
    """
    settled: list[str] = []
    requeued: list[str] = []
    adopted: list[TaskRow] = []
    left: set[str] = set()
    for row in sorted(store.all(), key=lambda r: r.created_at):
        if row.info().terminal or row.owner is None or row.owner.alive() or row.owner == me:
            continue
        if not adopt and _for_a_service(settings, row):
            left.add(row.id)
            continue
        if not store.claim(row.id, row.owner, me):
            continue
        settled.append(row.id)
        if row.status == "queued" and requeue(settings, store, row):
            requeued.append(row.id)
            continue
        if row.status == "running":
            why = adopt_refusal(settings, row)
            if why is None:
                adopted.append(store.get(row.id))
                continue
            if never_started(settings, row) and requeue(settings, store, row):
                requeued.append(row.id)  # died while launching: the agent never ran
                continue
            settle_orphan(settings, store, row, why)
            continue
        settle_orphan(settings, store, row, None)
    if left:
        log.info("tasks of a dead launcher left to the launcher service", tasks=sorted(left))
    remove_orphans(settings, store, keep=left)
    return settled, requeued, adopted


def _for_a_service(settings: Settings, row: TaskRow) -> bool:
    """Whether a launcher service would queue ``row`` again or re-adopt it."""
    if row.status == "queued":
        return True
    if row.status != "running":
        return False
    return adopt_refusal(settings, row) is None or never_started(settings, row)


def remove_orphans(settings: Settings, store: Store, *, keep: Collection[str] = ()) -> None:
    """Reap every sandbox and gateway of this data dir that no live task holds and no
    task in ``keep`` (left for another launcher) does.

    What runs is listed *before* the store is read: a launcher records a task (and its
    sandbox's name) before it starts the task's gateway and sandbox, so anything listed
    is in the records read after it. Read the other way round, a sandbox another
    launcher started between the two looked like an orphan and was killed.
    """
    # Every backend lists the sandboxes this data dir owns; each one no live task
    # holds is reaped by its own backend's verb (killed, what it wrote saved, removed;
    # a microVM whose owner is alive, an exec/shell, is left be by its backend).
    sandboxes = owned_sandboxes(settings)
    gateways = list_task_gateways(settings)
    rows = [r for r in store.all() if not r.info().terminal]
    held = [r for r in rows if r.id in keep]
    alive = [r for r in rows if r.owner is not None and r.owner.alive()]
    live = {r.sandbox for r in alive + held if r.sandbox}
    # A live task's sandboxes by name too: its [setup] sandbox runs before the agent's
    # name is recorded (reaping it there killed setup with SIGKILL, exit 137, whenever a
    # sweep, this run's own or another launcher's, listed while setup ran).
    live |= {n for r in alive + held for n in (sandbox_name(r.id), setup_sandbox_name(r.id))}
    for backend, name in sandboxes:
        # Logged only when something was removed: a listed microVM whose owner is
        # alive (another process's exec or shell) is left be by its backend's reap.
        if name not in live and (removed := reap_sandbox(backend, name, settings.data_dir)):
            log.warning("removed an orphan sandbox", sandbox=name, backend=backend, removed=removed)
    # A live sandbox keeps its host uid range (a re-adopted task's); one whose sandbox
    # is gone and whose holder died (a launcher killed mid-task) is freed.
    for slot in reap_uid_slots(settings, {n for _, n in sandboxes if n in live}):
        log.info("freed the uid range of a sandbox that is gone", slot=slot)
    # Workspace disks still mounted for a sandbox no process holds any more (an SDK
    # sandbox or spare of a launcher that was killed: not a task's, so not listed above).
    for name in settle_dead_disks(settings):
        log.warning("settled the workspace disk of a sandbox whose owner is gone", sandbox=name)
    # Warm pools: not in what the backends list above; a dead keeper's entries go here.
    for name in sweep_pools(settings):
        log.warning("removed a pooled sandbox whose keeper is gone", sandbox=name)
    live_ids = {r.id for r in alive + held}
    for task_id, gw in gateways:
        if task_id not in live_ids:
            log.warning("removing orphan gateway", task_id=task_id, pid=gw.pid)
            kill_gateway(gw)
