"""A per-task host service we spawn (the gateway, the egress proxy): its handle and ready wait.

Both are child processes in their own process group that bind a unix socket, drop
their privileges, then write ``ready`` on a pipe the parent passed them: a socket
that accepts is not proof enough, it is bound before the drop. The handle stops the
whole group (TERM, then KILL) and removes the socket; stopping is idempotent.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Self

from agentbox.core.proc import kill_group
from agentbox.errors import AgentboxError

__all__ = ["ServiceHandle", "wait_ready"]


def wait_ready(fd: int, timeout: float, *, what: str, error: type[AgentboxError]) -> None:
    """Wait for the child's ``ready`` line on ``fd``.

    Raises ``error`` naming ``what`` if the child closes the pipe, says anything else,
    or is not ready within ``timeout`` seconds.
    """
    got = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in got:
        left = deadline - time.monotonic()
        if left <= 0:
            raise error(f"{what} not ready within {timeout:g}s")
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 64)
        if not chunk:
            raise error(f"{what} exited before it was ready")
        got += chunk
    if not got.startswith(b"ready"):
        raise error(f"{what} said {got[:64]!r} instead of ready")


class ServiceHandle:
    """A running service process: ``pid``, ``alive()``, idempotent ``stop()``, a context manager."""

    def __init__(self, proc: subprocess.Popen[bytes], *, socket_path: Path) -> None:
        self._proc = proc
        self.socket_path = socket_path

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once it exited, else None."""
        return self._proc.poll()

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self._proc.poll() is None

    def stop(self, grace: float = 5.0) -> int | None:
        """TERM the process group, KILL it after ``grace`` s, remove the socket; idempotent.

        Returns the exit code. ``grace`` lets in-flight work finish and be recorded.
        """
        kill_group(self._proc, grace=grace)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        return self._proc.poll()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(pid={self.pid}, socket={self.socket_path}, alive={self.alive()})"
