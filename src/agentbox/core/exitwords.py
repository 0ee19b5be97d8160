"""An exit code in words: ``137`` is ``killed by SIGKILL``, with why when it is known.

A process killed by a signal shows as 128 + the signal's number (a shell's, podman's
and docker's convention); the number alone does not say the process was killed, nor
by what. :func:`oom_kills` reads the kernel's count of OOM kills (``oom_kill`` in
``/proc/vmstat``, counted for cgroup OOMs too), so a caller that reads it before and
after a run can tell an out-of-memory kill from one of ours.
"""

from __future__ import annotations

import signal

__all__ = ["exit_words", "kill_cause", "oom_kills"]


def oom_kills() -> int | None:
    """The host's OOM kills so far (``/proc/vmstat`` ``oom_kill``; None if unreadable)."""
    try:
        with open("/proc/vmstat", "rb") as fh:
            for line in fh:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def kill_cause(
    *, timed_out: bool, cancelled: bool, oom_before: int | None, oom_after: int | None
) -> str:
    """Why a process died of a signal, from what its runner knows."""
    if timed_out:
        return "its deadline passed"
    if cancelled:
        return "the task was cancelled"
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return "out of memory: the kernel's OOM killer ran while it did"
    return "not by agentbox's deadline or cancel, and no OOM kill was counted"


def exit_words(code: int | None, cause: str | None = None) -> str:
    """``exit 1``; ``exit 137: killed by SIGKILL (cause)`` for a code above 128."""
    if code is None:
        return "no exit code"
    if code <= 128 or code > 128 + 64:
        return f"exit {code}"
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    return f"exit {code}: killed by {name}" + (f" ({cause})" if cause else "")
