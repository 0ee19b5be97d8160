"""Following a task's sandbox to its end: the same code for the launcher that started it
and for a launcher that re-adopted it after the first one died.

A detached sandbox (:meth:`~agentbox.backends.base.Backend.launch`) writes its
output to ``logs/sandbox.log`` through the runtime; :func:`follow_sandbox`
streams that log from its start into ``agent.jsonl``/``agent.stderr`` (capped,
as an attached run's are), waits for the end, turns a cancel into a kill on the
way, and says how the task ended. The agent's files are rewritten from the
start on each follow, so a re-adopting launcher's copy is whole and in order,
never a duplicate of what the dead one had copied.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from agentbox.backends.base import Backend
from agentbox.core.log import get_logger
from agentbox.launcher._context import TaskContext
from agentbox.launcher._watchdog import kill_sandbox
from agentbox.observe.resources import watch as watch_resources

log = get_logger(__name__)

#: Each of the agent's log files (stdout, stderr) is capped.
MAX_LOG_BYTES = 64 << 20

#: How a task's agent ended: (status, error, exit code).
Ended = tuple[str, str | None, int | None]


def sink(fh: BinaryIO, limit: int = MAX_LOG_BYTES) -> Callable[[bytes], None]:
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


#: After a cancel's kill, how long the monitor waits for the follow to end before it
#: kills again (the last repeats until it ends). The follow also removes the sandbox and
#: copies its disk back, so a repeat may find it already dead: a harmless no-op.
KILL_AGAIN_AFTER = (2.0, 5.0, 10.0)


def monitor(ctx: TaskContext, done: threading.Event, backend: str, sandbox: str) -> None:
    """Turn a cancel (this process's event, or another process's flag) into a kill, and
    kill again until the sandbox has ended (``done``).

    One kill is not enough: it can be sent while the sandbox is still being started
    (no container yet: nothing to kill), or be refused or time out under load (the
    runtime busy); a monitor that stopped after it left the sandbox, and the task,
    running to its deadline. Killing an ended sandbox is a no-op, so repeating is safe.
    """
    while not done.wait(0.5):
        if ctx.cancelled():
            break
    else:
        return  # the sandbox ended: no cancel to act on
    for attempt in itertools.count():
        kill_sandbox(backend, sandbox, ctx.paths.data_dir)
        wait = KILL_AGAIN_AFTER[min(attempt, len(KILL_AGAIN_AFTER) - 1)]
        if done.wait(wait):
            return
        log.info(
            "the sandbox's follow has not ended since the cancel's kill; killing it again",
            task_id=ctx.task_id,
            sandbox=sandbox,
            attempt=attempt + 2,
        )


def ended(
    ctx: TaskContext,
    *,
    exit_code: int,
    timed_out: bool,
    deadline: float,
    past_deadline: bool,
) -> Ended:
    """The task's status from how its sandbox ended (the same rules, attached or detached)."""
    if ctx.cancel.is_set() or ctx.store.get(ctx.task_id).cancel_requested:
        return "cancelled", "cancelled while running; partial result collected", exit_code
    if timed_out or past_deadline:
        return "timed_out", f"killed at its deadline ({deadline:g}s)", exit_code
    if exit_code == 0:
        return "done", None, exit_code
    if exit_code == -1:
        why = "the agent's end is unknown: its sandbox's monitor died (see the launcher log)"
        return "failed", f"{why}; partial result collected", exit_code
    return "failed", f"the agent exited with code {exit_code}", exit_code


def follow_sandbox(
    ctx: TaskContext,
    backend: Backend,
    backend_name: str,
    *,
    name: str,
    deadline: float,
    deadline_at: float,
    adopted: bool = False,
) -> Ended:
    """Follow the detached sandbox ``name`` of this task to its end; how it ended.

    Raises what :meth:`~agentbox.backends.base.Backend.follow` raises
    (:class:`~agentbox.errors.SandboxGone` when there is no such sandbox).
    ``adopted``: the timing is the runtime's word only (``timed_out``): a launcher that
    comes back long after the agent ended must not call it late.
    """
    paths = ctx.paths
    done = threading.Event()
    watcher = threading.Thread(
        target=monitor,
        args=(ctx, done, backend_name, name),
        name=f"agentbox-monitor-{paths.task_id}",
        daemon=True,
    )
    watcher.start()
    try:
        # "wb": the follow replays the log from its start; what a dead launcher had
        # copied is rewritten, never appended to twice.
        with (
            (paths.log_dir / "agent.jsonl").open("wb") as out,
            (paths.log_dir / "agent.stderr").open("wb") as err,
            watch_resources(paths.root, backend_name, name, paths.workspace),
        ):
            exited = backend.follow(
                name, log=paths.log_dir / "sandbox.log", on_stdout=sink(out), on_stderr=sink(err)
            )
    finally:
        done.set()
    ctx.tlog(f"agent exited with code {exited.exit_code}")
    return ended(
        ctx,
        exit_code=exited.exit_code,
        timed_out=exited.timed_out,
        deadline=deadline,
        past_deadline=not adopted and time.time() >= deadline_at,
    )
