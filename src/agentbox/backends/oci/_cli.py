"""Process helpers shared by the podman backend's modules.

Environment values travel to podman in an anonymous, sealed memory file (never
on a command line, where ``ps`` shows them, and never on disk, where a SIGKILLed
caller would leave them); stdin in a temp file; output through a bounded
collector that keeps a tail for error messages. Removal is forced and retried.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from agentbox.backends.base import OutputCallback
from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError, CommandError, ConfigError, SandboxError

#: Output kept in memory per stream when no callback is given; the rest is dropped.
MAX_CAPTURE = 64 * 1024 * 1024
#: copy_out refuses archives bigger than this (the sandbox controls their size).
MAX_COPY_OUT = 4 * 1024**3
#: The memfd's name, as ``/proc/PID/fd`` shows it (``/memfd:agentbox-env (deleted)``).
ENV_MEMFD_NAME = "agentbox-env"
_ENV_NAME_OK = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not name or name[0].isdigit() or not set(name) <= _ENV_NAME_OK or len(name) > 128:
            raise ConfigError(f"not an environment variable name: {name!r:.60}")
        if "\n" in value or "\0" in value:
            raise ConfigError(f"environment variable {name} contains a newline or NUL")


@dataclass(frozen=True)
class EnvFile:
    """An environment file podman reads through this process's descriptor.

    Pass :attr:`path` as ``--env-file``. It names *our* descriptor
    (``/proc/<our pid>/fd/N``), which the podman client opens (same uid) and reads
    at once. The descriptor is close-on-exec and never inherited: an inherited one
    would outlive the read, because podman's Go runtime hands every inherited
    descriptor on to conmon, which keeps it for the sandbox's whole life.
    """

    fd: int
    pid: int

    @property
    def path(self) -> Path:
        """What the podman child opens: a new read of our memory file, from offset 0."""
        return Path(f"/proc/{self.pid}/fd/{self.fd}")


_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@contextlib.contextmanager
def env_file(env: Mapping[str, str]) -> Iterator[EnvFile]:
    """Environment values for podman in an anonymous memory file; nothing on disk.

    Values (a task's one-time gateway token among them) must never be on a command
    line (``ps`` shows it) nor in a file on disk: a caller killed with SIGKILL runs
    no cleanup and would leave it behind. A memfd has no name in any filesystem and
    vanishes with its last descriptor, so nothing survives us. It is sealed before
    podman sees it (nobody can change what podman reads) and close-on-exec (no
    child inherits it). podman 4.3 reads ``--env-file`` in its client process for
    ``run``, ``run -d``, ``create`` and ``exec``; conmon, the runtime and the
    sandbox never hold it (tests/integration/test_podman_env.py checks each).
    Use the path only while the context is open, from this process's children.
    """
    check_env(env)
    data = "".join(f"{k}={v}\n" for k, v in env.items()).encode()
    try:
        fd = os.memfd_create(ENV_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise SandboxError(f"could not create the environment memfd: {exc}") from exc
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        yield EnvFile(fd, os.getpid())
    finally:
        os.close(fd)


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


def cgroup_pids(pid: int) -> list[int]:
    """Every process in ``pid``'s pids cgroup (the whole container), ``pid`` included."""
    pids: set[int] = {pid}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return sorted(pids)
    found: Path | None = None
    for line in lines:
        _, ctrls, path = ([*line.split(":", 2), "", ""])[:3]
        if "pids" in ctrls.split(","):
            found = Path(f"/sys/fs/cgroup/pids{path}")
            break
        if ctrls == "" and Path(f"/sys/fs/cgroup{path}/cgroup.controllers").exists():
            found = Path(f"/sys/fs/cgroup{path}")
    if found is not None:
        with contextlib.suppress(OSError, ValueError):
            pids |= {int(x) for x in (found / "cgroup.procs").read_text().split()}
    return sorted(pids)
