"""The one subprocess helper.

Argument lists only (never a shell string), always a timeout, output captured,
the argv logged, and failures raised as :class:`~agentbox.errors.CommandError`
carrying the exit code and the tail of stderr. A child that outlives its
timeout is killed with its whole process group (it runs in a session of its
own), so nothing it forked survives.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import CommandError, CommandTimeout

__all__ = ["Result", "kill_group", "run", "stream"]

log = get_logger(__name__)

DEFAULT_TIMEOUT = 120.0


@dataclass(frozen=True)
class Result:
    """What a finished command left: argv, exit code, and its output."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def kill_group(proc: subprocess.Popen[bytes], grace: float = 2.0) -> None:
    """TERM then KILL the child's process group; idempotent."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    # The leader is gone; make sure stragglers of its group are too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> Result:
    """Run ``argv`` to completion and return its output (text, utf-8 with replacement).

    Raises :class:`CommandTimeout` past ``timeout`` and, with ``check``,
    :class:`CommandError` on a non-zero exit.
    """
    args = tuple(os.fspath(a) for a in argv)
    log.debug("run", argv=args, timeout=timeout)
    data = input.encode() if isinstance(input, str) else input
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out_b, err_b = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        kill_group(proc)
        out_b, err_b = proc.communicate()
        raise CommandTimeout(args, timeout, err_b.decode(errors="replace")) from exc
    except BaseException:
        kill_group(proc)
        raise
    res = Result(
        args, proc.returncode, out_b.decode(errors="replace"), err_b.decode(errors="replace")
    )
    if check and proc.returncode != 0:
        raise CommandError(args, proc.returncode, res.stderr, res.stdout)
    return res


def stream(
    argv: Sequence[str | os.PathLike[str]],
    *,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None],
    timeout: float | None = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    stdin: int | None = subprocess.DEVNULL,
) -> int:
    """Run ``argv``, handing each chunk of stdout/stderr to the callbacks as it arrives.

    Returns the exit code. Past ``timeout`` the process group is killed and
    :class:`CommandTimeout` raised (what was streamed so far has been delivered).
    """
    args = tuple(os.fspath(a) for a in argv)
    log.debug("stream", argv=args, timeout=timeout)
    proc = subprocess.Popen(
        args,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, on_stdout)
    sel.register(proc.stderr, selectors.EVENT_READ, on_stderr)
    try:
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                kill_group(proc)
                raise CommandTimeout(args, timeout or 0.0)
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data(chunk)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return proc.wait(left)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc)
            raise CommandTimeout(args, timeout or 0.0) from exc
    except BaseException:
        kill_group(proc)
        raise
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
