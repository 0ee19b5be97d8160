"""``agentbox run`` and ``agentbox resume``: delegate a task, in the foreground or detached.

In the foreground, the task runs in an in-process :class:`~agentbox.launcher.Launcher`
(the CLI runs as root, like the launcher) and is followed live; Ctrl-C, a hang-up,
TERM cancel it and collect the partial result (:mod:`agentbox.cli.reap`). With
``--detach`` it is submitted to the launcher service over its socket (started on
demand, :func:`agentbox.cli._client.ensure_service`), its id printed, and the
command exits: ``agentbox wait``, ``watch``, ``show`` and ``diff`` take it from there.

``resume ID "follow-up"`` is ``run`` on the same repo with ``continue_from`` set:
the new task starts from the previous task's result commit and the agent is given
the previous task's transcript (:mod:`agentbox.launcher._session`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from agentbox.boxfile import Boxfile, load_boxfile
from agentbox.config import Settings, load_settings
from agentbox.core.paths import validate_task_id
from agentbox.errors import PolicyRefused
from agentbox.launcher.api import TaskInfo, TaskRequest
from agentbox.launcher.pushapi import PushRequest

_TASK_ARG = typer.Argument(help="What the agent should do; '-' reads it from stdin.")
_DETACH_HELP = (
    "Submit to the launcher service (started if none runs), print the task id and exit; "
    "follow it with agentbox wait/watch."
)


def register(app: typer.Typer) -> None:
    """Add ``run`` and ``resume`` to the CLI."""

    @app.command("run")
    def run(
        task: Annotated[str | None, _TASK_ARG] = None,
        repo: Annotated[
            Path | None,
            typer.Option(
                "--repo",
                help="The git repo, inside the repos root (default: the one containing "
                "the current directory).",
            ),
        ] = None,
        model: str | None = typer.Option(None, "--model", help="A model from `agentbox models`."),
        budget: int | None = typer.Option(None, "--budget", help="Token budget (default 20M)."),
        budget_usd: float | None = typer.Option(
            None, "--budget-usd", help="Dollar budget at the model's prices (default: none)."
        ),
        deadline: float | None = typer.Option(None, "--deadline", help="Seconds (10..86400)."),
        boxfile: Annotated[
            Path | None, typer.Option("--boxfile", help="A Boxfile for the sandbox.")
        ] = None,
        include_uncommitted: bool = typer.Option(
            False, "--include-uncommitted", help="Copy uncommitted changes too."
        ),
        task_id: str | None = typer.Option(None, "--id", help="Task id (default: generated)."),
        no_publish: bool = typer.Option(
            False, "--no-publish", help="Keep the result in the shadow git dir only."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        task_file: Annotated[
            Path | None,
            typer.Option("--task-file", help="Read the task from this file ('-': stdin)."),
        ] = None,
        backend: str | None = typer.Option(
            None, "--backend", help="podman, docker, qemu, firecracker (overrides the Boxfile)."
        ),
        runtime: str | None = typer.Option(
            None, "--runtime", help="OCI runtime: runc, crun or runsc (overrides the Boxfile)."
        ),
        detach: bool = typer.Option(False, "--detach", "-d", help=_DETACH_HELP),
        pr: bool = typer.Option(
            False,
            "--pr",
            help="When done with changes: push the branch to the repo's remote "
            "and open a pull request with the report (as `agentbox publish ID --pr`).",
        ),
        draft: bool = typer.Option(False, "--draft", help="With --pr: a draft pull request."),
        remote: str = typer.Option("origin", "--remote", help="With --pr: the remote."),
        attempts: int | None = typer.Option(
            None,
            "--attempts",
            min=1,
            max=8,
            help="Best-of-N: run N attempts (1..8) as one group, score them, publish the pick "
            "as agentbox/GROUP (each also as agentbox/GROUP-aK); --id names the group.",
        ),
        budget_split: str = typer.Option(
            "split",
            "--budget-split",
            help="With --attempts: 'split' (each attempt gets budget/N) or 'shared' (the "
            "attempts draw from the one budget, never passed in total).",
        ),
        pick_by: str = typer.Option(
            "tests",
            "--pick-by",
            help="With --attempts: tests (first passing, then smallest diff), diff, tokens, "
            "cost or time.",
        ),
    ) -> None:
        """Delegate TASK to Claude Code in a sandbox; print the report and the branch's diff."""
        text = _task_text(task, task_file)
        settings = _settings()
        if pr and (detach or no_publish):
            raise PolicyRefused(
                "--pr goes with a foreground run that publishes; for a detached or "
                "--no-publish task, run `agentbox publish ID --pr` once it is done"
            )
        if draft and not pr:
            raise typer.BadParameter("--draft goes with --pr")
        push = _push_request(remote, draft) if pr else None
        if detach and (boxfile is not None or backend is not None or runtime is not None):
            raise PolicyRefused(
                "--detach submits to the launcher service, which takes the sandbox from the "
                "repo's committed .agentbox/Boxfile.toml only; run --boxfile/--backend/--runtime "
                "in the foreground (or commit the Boxfile)"
            )
        box = None if detach else _boxfile(settings, boxfile)
        overrides = {k: v for k, v in (("backend", backend), ("runtime", runtime)) if v}
        if task_id is not None:
            validate_task_id(task_id)
        req = _request(
            repo=str(_repo_or_cwd(repo)), task=text, model=model, budget=budget,
            budget_usd=budget_usd, deadline=deadline, task_id=task_id,
            include_uncommitted=include_uncommitted, publish=not no_publish,
        )  # fmt: skip
        if attempts is not None:
            from agentbox.cli._attempts import run_group
            from agentbox.launcher.attempts import PICK_RULES

            if budget_split not in ("split", "shared"):
                raise typer.BadParameter("split or shared", param_hint="--budget-split")
            if pick_by not in PICK_RULES:
                raise typer.BadParameter(f"one of {', '.join(PICK_RULES)}", param_hint="--pick-by")
            if pr:
                raise PolicyRefused(
                    "--pr goes with one task; for a group, push its pick once it is done: "
                    "`agentbox publish GROUP-aK --pr` (K: the pick, `agentbox show GROUP`)"
                )
            if detach:
                _detach_group(settings, req, attempts, as_json=as_json, split=budget_split)
            run_group(req, box, attempts=attempts, pick_by=pick_by, as_json=as_json,
                      overrides=overrides, budget_split=budget_split)  # fmt: skip
        if detach:
            _detach(settings, req, as_json=as_json)
        _foreground(req, box, as_json=as_json, overrides=overrides, push=push, settings=settings)

    @app.command("resume")
    def resume(
        previous: Annotated[str, typer.Argument(help="The finished task to continue.")],
        task: Annotated[str | None, _TASK_ARG] = None,
        model: str | None = typer.Option(
            None, "--model", help="A model from `agentbox models` (default: the previous one)."
        ),
        budget: int | None = typer.Option(None, "--budget", help="Token budget (default 20M)."),
        budget_usd: float | None = typer.Option(
            None, "--budget-usd", help="Dollar budget at the model's prices (default: none)."
        ),
        deadline: float | None = typer.Option(None, "--deadline", help="Seconds (10..86400)."),
        task_id: str | None = typer.Option(None, "--id", help="Task id (default: generated)."),
        no_publish: bool = typer.Option(
            False, "--no-publish", help="Keep the result in the shadow git dir only."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        task_file: Annotated[
            Path | None,
            typer.Option("--task-file", help="Read the task from this file ('-': stdin)."),
        ] = None,
        detach: bool = typer.Option(False, "--detach", "-d", help=_DETACH_HELP),
    ) -> None:
        """Continue a finished task: a new task on its branch, told what the previous one did.

        The new branch agentbox/NEW stacks on agentbox/PREVIOUS (which must be published:
        agentbox publish PREVIOUS). The agent gets the previous task's request, transcript
        and last message in .git/agentbox/previous-task.md.
        """
        from agentbox.cli._client import in_process

        text = _task_text(task, task_file)
        settings = _settings()
        launcher = in_process(1, settings)
        try:
            prev = launcher.get(validate_task_id(previous))
            flagged = _flagged_of(launcher, prev.id)
        finally:
            launcher.close(wait=False)
        if task_id is not None:
            validate_task_id(task_id)
        req = _request(
            repo=prev.repo, task=text, model=model or prev.model, budget=budget,
            budget_usd=budget_usd, deadline=deadline, task_id=task_id, publish=not no_publish,
            continue_from=prev.id,
        )  # fmt: skip
        _show_flagged(prev.id, flagged)
        if detach:
            _detach(settings, req, as_json=as_json)
        _foreground(req, None, as_json=as_json, settings=settings)


def _settings() -> Settings:
    """The settings: in a command the front end forked, those it loaded as it became this
    command (the caller's environment and config file, moments ago: checked to name the
    front end's data dir), not loaded a second time; else :func:`load_settings`."""
    child = sys.modules.get("agentbox.front._child")
    checked = getattr(child, "checked_settings", None)
    return checked if isinstance(checked, Settings) else load_settings()


def _flagged_of(launcher: Any, task_id: str) -> list[Any]:
    """The flagged paths of a finished task's result (its report's), or []."""
    from agentbox.errors import AgentboxError

    try:
        got = launcher.result(task_id).report.get("flagged")
    except AgentboxError:
        return []
    return got if isinstance(got, list) else []


def _show_flagged(task_id: str, flagged: list[Any]) -> None:
    """Before a resume starts: the paths of the branch it continues that make tools run
    code (the new agent's Claude Code reads that branch's .claude/ settings and hooks).
    On stderr, so --json output stays JSON."""
    if not flagged:
        return
    from agentbox.cli._view import err, safe

    err.print(safe(
        f"WARNING: the branch of {task_id} this task continues has {len(flagged)} path(s) "
        "that make tools run code (the new agent starts on them; its Claude Code runs the "
        "hooks in .claude/, inside the sandbox):", "bold yellow",
    ))  # fmt: skip
    for f in flagged[:200]:
        if isinstance(f, dict):
            line = f"  {f.get('change', '?')} {f.get('path', '?')}: {f.get('reason', '')}"
            err.print(safe(line, "yellow"), soft_wrap=True)


def _boxfile(settings: Settings, path: Path | None) -> Boxfile | None:
    """The ``--boxfile`` (its image built here if it names a Containerfile), or None:
    the launcher then reads the repo's committed one. ``--backend``/``--runtime`` are
    applied by the launcher on top of either (:func:`agentbox.env.with_overrides`)."""
    box = load_boxfile(path, settings) if path is not None else None
    if box is not None and box.image_build is not None:
        # [image] containerfile = …: built here (cached), never by the launcher.
        from agentbox.image import build_for_boxfile

        box = build_for_boxfile(settings, box)
    return box


def _repo_or_cwd(repo: Path | None) -> Path:
    """``--repo``, or the git repository containing the current directory (as git finds
    it: the nearest directory upwards holding ``.git``; found by looking, never by
    running git in a repo that is not ours yet)."""
    if repo is not None:
        return repo.expanduser().absolute()
    here = Path.cwd()
    for d in (here, *here.parents):
        if (d / ".git").exists():
            return d
    raise typer.BadParameter(
        f"{here} is not inside a git repository: give --repo PATH (or cd into one)",
        param_hint="--repo",
    )


def _request(**fields: Any) -> TaskRequest:
    try:
        return TaskRequest(**fields)
    except ValidationError as exc:  # in the flags' words: --deadline must be at least 10 seconds
        from agentbox.core.invalid import flag_message

        raise PolicyRefused(flag_message(exc)) from exc


def _detach(settings: Settings, req: TaskRequest, *, as_json: bool) -> None:
    """Submit to the launcher service; print the id (``{"id": …}`` with --json) and exit 0."""
    from agentbox.cli._client import ensure_service
    from agentbox.cli._view import dump, err, safe

    say = (lambda m: None) if as_json else (lambda m: err.print(safe(m)))
    client = ensure_service(settings, say=say)
    try:
        info = client.submit(req)
    finally:
        client.close()
    _say_scripted(info.model, settings)
    if as_json:
        dump({"id": info.id})
    else:
        sys.stdout.write(info.id + "\n")
        sys.stdout.flush()
        err.print(
            safe(
                f"task {info.id} {info.status}: agentbox watch {info.id} · agentbox wait {info.id}"
            )
        )
    raise typer.Exit(0)


def _detach_group(
    settings: Settings, req: TaskRequest, attempts: int, *, as_json: bool, split: str = "split"
) -> None:
    """``run --attempts N --detach``: the group to the launcher service, which publishes
    its pick when the last attempt ends; print the group id (``{"group", "attempts"}``)."""
    from agentbox.cli._client import ensure_service
    from agentbox.cli._view import dump, err, safe

    say = (lambda m: None) if as_json else (lambda m: err.print(safe(m)))
    client = ensure_service(settings, say=say)
    try:
        infos = client.submit_group(req, attempts, budget_split=split)
    finally:
        client.close()
    group = infos[0].group or ""
    if as_json:
        dump({"group": group, "attempts": [i.id for i in infos]})
    else:
        sys.stdout.write(group + "\n")
        sys.stdout.flush()
        err.print(safe(f"group {group}: {len(infos)} attempts queued: agentbox show {group}"))
    raise typer.Exit(0)


def _foreground(
    req: TaskRequest,
    box: Boxfile | None,
    *,
    as_json: bool,
    overrides: dict[str, str] | None = None,
    push: PushRequest | None = None,
    settings: Settings | None = None,
) -> None:
    """Run the task in this process and follow it; with ``push``, once it is done with a
    result, push it and open the pull request (``run --pr``).

    The task is submitted first: what only following and printing need (rich, the
    report's views) is imported while its sandbox starts, and the orphan sweep
    runs beside it (:func:`_sweep_beside`).
    """
    from agentbox.cli._client import in_process
    from agentbox.cli.reap import exit_on_signals

    launcher = in_process(settings=settings)
    # TERM, HUP, … act like Ctrl-C (cancel, collect the partial result); a SIGKILL
    # is answered by the task's watchdog, which reaps the sandbox and the gateway,
    # and the task is settled by the next launcher (or `agentbox wait`/`show`).
    with exit_on_signals():
        task = _Submitted()
        sweep = _sweep_beside(launcher, task)
        try:
            try:
                info = launcher.submit(req, boxfile=box, overrides=overrides)
                task.id = info.id
            finally:
                task.known.set()  # the id, or no task (a refusal): the sweep may go on
            _say_scripted(info.model, launcher.settings)
            info = _follow(launcher, info, as_json=as_json)
        except KeyboardInterrupt:
            launcher.shutdown()  # interrupted before _follow took over: cancel, collect
            raise
        finally:
            task.gone.set()  # followed to its end (or given up): sweep now if not yet
            sweep.join()
            launcher.close()
    from agentbox.cli._view import dump, print_diff, report_text

    res = launcher.result(info.id)
    pushed = None
    if push is not None and info.status == "done" and res.changed and res.branch:
        pushed = launcher.push(info.id, push, env=dict(os.environ))
    if as_json:
        out = {"task": info.model_dump(mode="json"), "result": res.model_dump(mode="json")}
        if pushed is not None:
            out["push"] = pushed.model_dump(mode="json")
        dump(out)
    else:
        report_text(info, res)
        print_diff(res)
        if pushed is not None:
            from agentbox.cli._publish import print_push

            print_push(pushed)
        elif push is not None:
            sys.stderr.write(f"no pull request: task {info.id} {_no_pr_reason(info, res)}\n")
    raise typer.Exit(0 if info.status == "done" else 1)


def _push_request(remote: str, draft: bool) -> PushRequest:
    try:
        return PushRequest(remote=remote, pr=True, draft=draft)
    except ValidationError as exc:
        raise typer.BadParameter(f"not a remote name: {remote!r:.80}") from exc


def _no_pr_reason(info: TaskInfo, res: Any) -> str:
    if info.status != "done":
        return f"ended {info.status}"
    return "changed nothing" if not res.changed else "has no published branch"


def _say_scripted(model: str, settings: Settings) -> None:
    """One line on stderr when the task's model is scripted."""
    from agentbox.gateway.registry import scripted_note

    note = scripted_note(model, settings)
    if note is not None:
        sys.stderr.write(note + "\n")
        sys.stderr.flush()


class _Submitted:
    """What the orphan sweep of a foreground run waits on: the task's id once submitted
    (``known`` set, ``id`` None for a refused request) and the command's end (``gone``)."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.known = threading.Event()
        self.gone = threading.Event()


#: The sweep waits at most this long for the task's sandbox to run (a ``[setup]`` phase,
#: a slow start): then it sweeps beside whatever the task is doing.
SWEEP_WAIT = 10.0
#: How often it looks at the task's row meanwhile (one SQLite read).
SWEEP_POLL = 0.05


def _wait_for_the_sandbox(launcher: Any, task: _Submitted) -> None:
    """Until the task has left the queue (its sandbox launched, or it ended), was never
    submitted, or the command ends; at most :data:`SWEEP_WAIT` seconds."""
    from agentbox.errors import AgentboxError

    until = time.monotonic() + SWEEP_WAIT
    if not task.known.wait(SWEEP_WAIT) or task.id is None:
        return
    while time.monotonic() < until and not task.gone.is_set():
        try:
            if launcher.store.get(task.id).status != "queued":
                return
        except AgentboxError:
            return
        task.gone.wait(SWEEP_POLL)


def _sweep_beside(launcher: Any, task: _Submitted) -> threading.Thread:
    """The orphan sweep of a foreground run (``reconcile(adopt=False)``: others' tasks
    are the service's to adopt), on a thread beside the task instead of before it, and
    only once the task's sandbox runs (:func:`_wait_for_the_sandbox`): its podman and
    docker listings and process scan (0.1-0.3 s of CPU) then overlap the agent, which
    waits on its model, instead of the workspace copy and the sandbox's start, which
    are this process's own work on the user's wait (a 2-core host has no core to spare
    for both).

    Safe while this launcher starts its task: the sweep lists what runs before it
    reads the records, and a task is recorded before its gateway and sandbox start
    (:func:`agentbox.launcher._adopt.remove_orphans`); a task of this launcher is
    never an orphan. A sweep that fails is logged; the task goes on.

    The thread runs at a low CPU priority (nice 10, its own: Linux's nice value is per
    thread, and the podman listings it starts inherit it): on a small host its 0.1-0.3 s
    of CPU would otherwise compete with the task's start (podman, conmon, runc, the
    agent's own start) for the same cores. Not 19: the command waits for the sweep
    before it exits, and on a host kept busy by other work a sweep at 19 would crawl.
    """
    from agentbox.core.log import get_logger

    def sweep() -> None:
        try:
            _low_priority()
            if _service_sweeps(launcher.settings):
                return
            _wait_for_the_sandbox(launcher, task)
            launcher.reconcile(adopt=False)
        except Exception as exc:  # the sweep is housekeeping: never the task's failure
            get_logger(__name__).warning("orphan sweep failed", error=str(exc)[-500:])

    thread = threading.Thread(target=sweep, name="agentbox-orphan-sweep")
    thread.start()
    return thread


#: The launcher service's lock under the data dir, an ``flock`` held for its life
#: (:class:`agentbox.launcher._server.InstanceLock`: ``RUN_DIR``/``LOCK_NAME``).
SERVICE_LOCK = ("run", "launcher.lock")


def _service_sweeps(settings: Settings) -> bool:
    """A launcher service runs for this data dir (a served command's always does): it
    sweeps orphans itself, every minute, off any task's path
    (:class:`agentbox.launcher._server.Sweeper`), and takes over what a dead launcher
    left; this run's sweep would be a second one, on its own task's start.

    Told by its lock in ``/proc/locks``: neither a connection to the service (its
    answer, in its process, competed with the task's start) nor an import of its
    server (uvicorn, starlette) in this one."""
    try:
        st = settings.data_dir.joinpath(*SERVICE_LOCK).stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in locks.splitlines():
        f = line.split()  # 1: FLOCK  ADVISORY  WRITE 1234 fe:00:15346791 0 EOF
        if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "WRITE" and f[5] == inode:
            return True
    return False


#: The nice value of the orphan sweep's thread: ~10% of a core against nice-0 work.
SWEEP_NICE = 10


def _low_priority() -> None:
    """This thread (only) to :data:`SWEEP_NICE`; never raised (a niced caller stays)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(SWEEP_NICE, os.getpriority(os.PRIO_PROCESS, tid)))


def _follow(launcher: Any, info: TaskInfo, *, as_json: bool) -> TaskInfo:
    """Follow the task; Ctrl-C (or any ending signal) cancels it and collects."""
    from agentbox.cli._follow import follow, quiet_print
    from agentbox.cli._logs import EventTail
    from agentbox.cli._view import console, err
    from agentbox.core.paths import TaskPaths

    task_id = info.id
    tail = EventTail(TaskPaths(launcher.settings.data_dir, task_id).root, info.created_at)
    try:
        return follow(
            lambda: launcher.get(task_id), tail,
            live=not as_json and console.is_terminal, events=not as_json,
            wait=lambda seconds: _wait_at_most(launcher, task_id, seconds),
        )  # fmt: skip
    except KeyboardInterrupt:
        quiet_print(err, "[magenta]cancelling; collecting the partial result…[/magenta]")
        launcher.cancel(task_id)
        done: TaskInfo = launcher.wait(task_id)
        return done


def _wait_at_most(launcher: Any, task_id: str, seconds: float) -> TaskInfo:
    """The task at its end (the launcher wakes on it) or after ``seconds``."""
    from agentbox.errors import TaskError

    try:
        info: TaskInfo = launcher.wait(task_id, timeout=seconds)
    except TaskError:  # still running
        info = launcher.get(task_id)
    return info


#: The most task text read from a file or stdin (the launcher caps it lower still).
MAX_TASK_BYTES = 1 << 20


def _task_text(task: str | None, task_file: Path | None) -> str:
    """The task from the argument, ``--task-file PATH`` or stdin (``-`` for either)."""
    if task is not None and task_file is not None:
        raise typer.BadParameter("give the task as an argument or --task-file, not both")
    if task is None and task_file is None:
        raise typer.BadParameter(
            "what should the agent do? Give TASK, '-' (stdin) or --task-file PATH",
            param_hint="TASK",
        )
    if task is not None and task != "-":
        return task
    try:
        if task == "-" or str(task_file) == "-":
            raw = sys.stdin.buffer.read(MAX_TASK_BYTES + 1)
            where = "stdin"
        else:
            assert task_file is not None
            with task_file.expanduser().open("rb") as fh:
                raw = fh.read(MAX_TASK_BYTES + 1)
            where = str(task_file)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot read {task_file}: {exc.strerror}", param_hint="--task-file"
        ) from exc
    if len(raw) > MAX_TASK_BYTES:
        raise typer.BadParameter(f"the task in {where} is over {MAX_TASK_BYTES} bytes")
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        raise typer.BadParameter(f"the task read from {where} is empty")
    return text
