"""Process helpers shared by the podman backend's modules.

Environment values travel to podman in an owner-only file (never on a command
line, where ``ps`` shows them); stdin in a temp file; output through a bounded
collector that keeps a tail for error messages. Removal is forced and retried.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import psutil

from agentbox import _proc
from agentbox.backends.base import OutputCallback
from agentbox.errors import AgentboxError, CommandError, ConfigError, SandboxError

__all__ = [
    "MAX_CAPTURE",
    "MAX_COPY_OUT",
    "Capture",
    "conmon_cwd",
    "env_file",
    "force_remove",
    "kill",
    "owner_start",
    "podman_error",
    "stdin_fd",
]

#: Output kept in memory per stream when no callback is given; the rest is dropped.
MAX_CAPTURE = 64 * 1024 * 1024
#: copy_out refuses archives bigger than this (the sandbox controls their size).
MAX_COPY_OUT = 4 * 1024**3
_ENV_NAME_OK = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not name or name[0].isdigit() or not set(name) <= _ENV_NAME_OK or len(name) > 128:
            raise ConfigError(f"not an environment variable name: {name!r:.60}")
        if "\n" in value or "\0" in value:
            raise ConfigError(f"environment variable {name} contains a newline or NUL")


@contextlib.contextmanager
def env_file(env: Mapping[str, str]) -> Iterator[Path]:
    """Values go to podman through an owner-only file, never on a command line (ps shows it)."""
    check_env(env)
    with tempfile.TemporaryDirectory(prefix="agentbox-env-") as d:
        path = Path(d) / "env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in env.items())
        yield path


@contextlib.contextmanager
def stdin_fd(data: bytes | None) -> Iterator[int]:
    if data is None:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        yield f.fileno()


class Capture:
    """Collects a stream (bounded) or forwards it; keeps a tail for error messages."""

    def __init__(self, callback: OutputCallback | None) -> None:
        self.callback = callback
        self.buf = bytearray()
        self.tail = b""

    def __call__(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-4096:]
        if self.callback is not None:
            self.callback(chunk)
        elif len(self.buf) < MAX_CAPTURE:
            self.buf += chunk[: MAX_CAPTURE - len(self.buf)]

    @property
    def data(self) -> bytes:
        return bytes(self.buf)


def force_remove(name: str, attempts: int = 5) -> None:
    """Kill and remove container ``name`` (absent is fine); raise if it survives.

    runsc sometimes still holds the container's shm mount when podman first
    tries to remove it ("device or resource busy"); a retry a moment later works.
    """
    err: CommandError | None = None
    for i in range(attempts):
        try:
            _proc.run(["podman", "rm", "--force", "--ignore", "--time", "0", name], timeout=60)
            return
        except CommandError as exc:
            err = exc
            time.sleep(0.2 * (i + 1))
    raise SandboxError(f"could not remove: {err}", sandbox=name) from err


def podman_error(tail: bytes) -> bool:
    """Whether stderr ends with podman's own error (the command never ran)."""
    return tail.startswith(b"Error: ") or b"\nError: " in tail


def kill(name: str) -> None:
    with contextlib.suppress(AgentboxError):
        _proc.run(["podman", "kill", "--signal", "KILL", name], timeout=30, check=False)


def owner_start() -> str:
    return f"{psutil.Process().create_time():.0f}"


def conmon_cwd() -> Path:
    """A private directory to start podman from (``run``, ``run -d``, ``exec``).

    conmon, which podman starts for each of those, inherits podman's working directory
    and, after an OOM kill in the sandbox, writes an ``oom`` marker file there. That
    must never be a user's repo or a test's cwd. The directory is ours alone (0700,
    our uid, not a link); a marker left in it is harmless.
    """
    d = Path(tempfile.gettempdir()) / f"agentbox-conmon-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SandboxError(f"{d} is not a private directory of ours (a link, or not 0700)")
    return d
