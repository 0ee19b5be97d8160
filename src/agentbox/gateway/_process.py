"""Start a gateway as a separate process and hold it: what the launcher calls per task.

The gateway runs as ``python -m agentbox.gateway …`` in its own session, so a
crash of the launcher's event loop cannot take it down mid-stream and ``stop()``
can signal the whole group. It outlives the launcher (a detached task is
re-adopted by the next one; the gateway stops by itself at ``--exit-at``), also
a ``systemctl restart`` of the launcher's unit: when the launcher runs in a
systemd service's cgroup, the gateway is moved out of it, in the two hierarchies
systemd kills a unit by (``name=systemd`` and the unified one), into
:data:`GATEWAY_CGROUP` at their root: it is born there (a ``sh`` enters the cgroup,
then ``exec``s the gateway), and :func:`leave_unit_cgroup` repeats the move. The token
travels in a file (0600), never on argv: ``/proc/<pid>/cmdline`` is readable by
every local user.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.service import ServiceHandle, wait_ready
from agentbox.core.wait import socket_accepts, wait_until
from agentbox.errors import GatewayError
from agentbox.gateway._listenfd import LISTEN_FD_ENV
from agentbox.gateway.registry import load_registry
from agentbox.linux.cgroups import enter_then_exec, unit_hierarchies

log = get_logger(__name__)

#: Environment variables the gateway child inherits (plus the upstream key variable).
_PASS_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "AGENTBOX_LOG_LEVEL",
    "AGENTBOX_LOG_JSON",
    "AGENTBOX_GATEWAY_LOG_CAP",
)
#: The gateway's uid is ``subid_base + 65536 + this``: past the 65536 ids podman maps
#: for sandboxes and the strict VMM's uid (``+ 1``), so it owns nothing anyone else uses.
GATEWAY_UID_OFFSET = 65536 + 2


#: The cgroup, at the root of the hierarchies systemd tracks units by, that gateways
#: started from a systemd service move to (shared, never removed: empty is harmless).
GATEWAY_CGROUP = "agentbox-gateways"


def _gateway_homes() -> list[tuple[str, Path]]:
    """(hierarchy, its :data:`GATEWAY_CGROUP` dir) for each hierarchy systemd kills a unit
    by where this process sits in a service's cgroup (``*.service``); the dirs made.

    Nothing where this process is not in a service's cgroup (a shell, a test, a
    container): only a unit's own cgroup is left, never another controller's.
    """
    mounts = unit_hierarchies()
    homes = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            num, ctrls, path = ([*line.split(":", 2), "", ""])[:3]
            key = "0" if num == "0" and not ctrls else ctrls
            if key not in mounts or not path.rstrip("/").endswith(".service"):
                continue
            target = mounts[key] / GATEWAY_CGROUP
            try:
                target.mkdir(exist_ok=True)
            except OSError as exc:
                log.warning("no cgroup to start the gateway in", hierarchy=key, error=str(exc))
                continue
            homes.append((key, target))
    return homes


def leave_unit_cgroup(pid: int) -> list[str]:
    """Move ``pid`` out of this process's systemd service cgroup (``*.service``) into
    :data:`GATEWAY_CGROUP`, in each hierarchy systemd kills a unit by; return those moved.

    The second line: :func:`spawn_gateway` starts the gateway there already (born
    outside, :func:`~agentbox.linux.cgroups.enter_then_exec`); this repeats the move in case
    the shell could not enter one.
    """
    moved = []
    for key, target in _gateway_homes():
        try:
            (target / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            log.warning("gateway left in the launcher's unit cgroup", pid=pid,
                        hierarchy=key, error=str(exc))  # fmt: skip
            continue
        moved.append(key)
    return moved


def gateway_identity(settings: Settings) -> tuple[int, int] | None:
    """The dedicated uid/gid the launcher's gateways drop to; None when not started as root
    (an unprivileged launcher's gateway already runs as that user)."""
    if os.geteuid() != 0:
        return None
    uid = settings.subid_base + GATEWAY_UID_OFFSET
    return uid, uid


def _state_dir(usage_file: Path, run_as: tuple[int, int]) -> Path:
    """A directory of the dropped gateway's own for its usage file, linked from ``usage_file``.

    The gateway writes its usage file through a descriptor of this directory, opened
    before the drop: the directories above it stay closed to it. ``usage_file`` becomes
    a link ``NAME -> NAME.d/NAME`` made here, in a directory the gateway cannot write;
    :func:`read_usage` follows that one link and no link inside the directory.
    """
    state = usage_file.with_name(usage_file.name + ".d")
    state.mkdir(mode=0o700, exist_ok=True)
    st = state.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise GatewayError(f"gateway state dir {state} is not a directory")
    os.chown(state, *run_as, follow_symlinks=False)
    state.chmod(0o700)
    with contextlib.suppress(FileNotFoundError):
        usage_file.unlink()
    usage_file.symlink_to(f"{state.name}/{usage_file.name}")
    return state / usage_file.name


def wait_for_socket(path: Path, *, timeout: float, proc: subprocess.Popen[bytes] | None) -> None:
    """Poll until a unix socket at ``path`` accepts a connection; GatewayError past ``timeout``."""

    def listening() -> bool:
        if proc is not None and proc.poll() is not None:
            raise GatewayError(f"gateway exited with code {proc.returncode} before listening")
        return socket_accepts(path)

    wait_until(
        listening,
        timeout=timeout,
        on_timeout=lambda: GatewayError(f"gateway did not listen on {path} within {timeout:g}s"),
    )


def _wait_ready(fd: int, timeout: float) -> None:
    """Wait for the child's ``ready`` line; GatewayError if it closes the pipe or is late."""
    wait_ready(fd, timeout, what="gateway", error=GatewayError)


class GatewayHandle(ServiceHandle):
    """A running gateway process: ``pid``, ``alive()``, ``wait_ready()``, ``stop()``
    (idempotent).

    ``stop(grace)`` gives in-flight requests ``grace`` seconds to finish and be written
    to the usage file.
    """

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        *,
        socket_path: Path,
        usage_file: Path,
        log_file: Path | None,
        ready_fd: int | None = None,
        timeout: float = 20.0,
    ) -> None:
        super().__init__(proc, socket_path=socket_path)
        self.usage_file = usage_file
        self.log_file = log_file
        self._ready_fd = ready_fd
        self._timeout = timeout
        self._ready_lock = threading.Lock()

    def wait_ready(self) -> None:
        """Return once the gateway serves (privileges dropped); at once if it already said so.

        Raises :class:`GatewayError` (its log's tail included) when it exits first or is
        not ready within the spawn's ``timeout``; the gateway is then stopped.
        """
        with self._ready_lock:
            fd, self._ready_fd = self._ready_fd, None
            if fd is None:
                return
            try:
                _wait_ready(fd, self._timeout)
                wait_for_socket(self.socket_path, timeout=self._timeout, proc=self._proc)
            except GatewayError as exc:
                super().stop(grace=1.0)
                tail = ""
                if self.log_file is not None:
                    with contextlib.suppress(OSError):
                        lines = self.log_file.read_text(errors="replace").splitlines()[-20:]
                        tail = "\n" + "\n".join(lines)
                raise GatewayError(f"{exc}{tail}") from exc
            finally:
                os.close(fd)

    def stop(self, grace: float = 5.0) -> int | None:
        with self._ready_lock:
            fd, self._ready_fd = self._ready_fd, None
        if fd is not None:  # never waited for: nothing will read its pipe now
            os.close(fd)
        return super().stop(grace)


def _listen_unix(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, mode 0660, bound here for the gateway to serve.

    Bound by the launcher, not the gateway: it exists (and can be handed to the
    sandbox's uid) the moment the gateway is started, so the sandbox may start while
    the gateway is still importing; a connection made meanwhile waits in the backlog
    until the gateway serves. No umask change (the launcher has other threads): the
    socket is bound with the process's umask (022: only root may connect) and then
    narrowed to 0660.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        path.chmod(0o660)  # just bound by us, in the task's gw/ (ours)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise GatewayError(f"cannot listen on {path}: {exc}") from exc
    return sock


def gateway_argv(
    *,
    listen: str,
    token_file: Path,
    model: str,
    budget: int,
    usage_file: Path,
    models_file: Path | None = None,
    upstream: str | None = None,
    max_concurrency: int | None = None,
    run_as: tuple[int, int] | None = None,
    ready_fd: int | None = None,
    max_memory: int | None = None,
    exit_at: float | None = None,
    budget_usd: float | None = None,
) -> list[str]:
    """The argv that runs a gateway with this interpreter (``python -m agentbox.gateway``,
    the same command as ``agentbox gateway``, without importing the whole CLI)."""
    argv = [sys.executable, "-m", "agentbox.gateway", "--listen", listen]
    argv += ["--token-file", str(token_file), "--model", model, "--budget", str(budget)]
    argv += ["--usage-file", str(usage_file)]
    if budget_usd is not None:
        argv += ["--budget-usd", repr(budget_usd)]
    if models_file is not None:
        argv += ["--models-file", str(models_file)]
    else:
        argv.append("--builtin-models")  # resolved here: the child reads no settings
    if upstream is not None:
        argv += ["--upstream", upstream]
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    if run_as is not None:
        argv += ["--user", f"{run_as[0]}:{run_as[1]}"]
    if max_memory is not None:
        argv += ["--max-memory", str(max_memory)]
    if ready_fd is not None:
        argv += ["--ready-fd", str(ready_fd)]
    if exit_at is not None:
        argv += ["--exit-at", repr(exit_at)]
    return argv


def spawn_gateway(
    *,
    socket_path: Path,
    token_file: Path,
    model: str,
    budget: int,
    usage_file: Path,
    settings: Settings,
    replay_script: Path | None = None,
    log_file: Path | None = None,
    timeout: float = 20.0,
    run_as: tuple[int, int] | None = None,
    max_memory: int | None = None,
    exit_at: float | None = None,
    wait: bool = True,
    budget_usd: float | None = None,
) -> GatewayHandle:
    """Start a gateway on ``socket_path`` for one task and wait until it answers.

    ``model`` must name a registry entry (:class:`ConfigError` otherwise, before
    anything starts); ``replay_script`` replaces its upstream with that replay
    script. The socket is created mode 0660; the usage file exists (all zeros)
    once this returns. Raises :class:`GatewayError` if the process does not listen
    within ``timeout`` seconds (its log tail included).

    ``run_as=(uid, gid)``: the gateway drops to that identity (no supplementary
    groups, no capabilities, ``no_new_privs``, a seccomp filter, see
    :mod:`._confine`) once its socket is bound and its token, key and script are
    read; the launcher passes :func:`gateway_identity`. Its usage file then lives in
    ``<usage_file>.d/`` (owned by that uid), and ``usage_file`` is a link to it that
    :func:`read_usage` follows. The socket stays owned by the starting user, mode
    0660: chown it to let the sandbox's relay in. Its log is capped (``_logcap``).
    ``max_memory``: its ``RLIMIT_AS`` in bytes (default: the gateway's own, 1 GiB;
    0: none, which only the escape suite's positive control asks for).
    ``exit_at``: the gateway stops by itself at this unix time (it outlives a launcher
    that dies; the launcher passes the task's deadline plus a grace).

    The socket is bound here and handed to the gateway (:data:`LISTEN_FD_ENV`), so it
    exists when this returns. ``wait=False`` returns as soon as the process started,
    before it serves (a Python process: 0.5-1 s): the caller overlaps that with its
    own work (the sandbox's start) and calls :meth:`GatewayHandle.wait_ready` before
    relying on it; connections made meanwhile wait in the socket's backlog.
    """
    entry = load_registry(settings).get(model)
    if not token_file.is_file():
        raise GatewayError(f"token file {token_file} does not exist")
    env = _child_env()
    secret_env = {}
    if entry.key_env and entry.key_env in os.environ and replay_script is None:
        secret_env[entry.key_env] = os.environ[entry.key_env]
    write_to = _state_dir(usage_file, run_as) if run_as is not None else usage_file
    argv = gateway_argv(
        listen=f"unix:{socket_path}",
        token_file=token_file,
        model=model,
        budget=budget,
        budget_usd=budget_usd,
        usage_file=write_to,
        models_file=settings.models_file,
        upstream=f"replay:{replay_script}" if replay_script is not None else None,
        run_as=run_as,
        max_memory=max_memory,
        exit_at=exit_at,
    )
    # It outlives the launcher, a unit restart too: born outside the unit's cgroup,
    # so no kill of the unit between its start and a move can reach it.
    cgroups = [home / "cgroup.procs" for _, home in _gateway_homes()] if exit_at else []
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    listener = _listen_unix(socket_path)
    # The child says "ready" on this pipe once it serves (and has dropped privileges):
    # a socket that accepts is not enough, it is bound before the drop.
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    out: IO[bytes] | int
    out = log_file.open("ab") if log_file is not None else subprocess.DEVNULL
    try:
        proc: subprocess.Popen[bytes] | None = None
        if settings.gateway_template:
            proc = _fork(argv, env, secret_env, listener, ready_w, out, cgroups, socket_path)
        if proc is None:
            env.update(secret_env)
            env[LISTEN_FD_ENV] = str(listener.fileno())
            argv += ["--ready-fd", str(ready_w)]
            log.info("spawn gateway", argv=argv, socket=str(socket_path))
            proc = subprocess.Popen(
                enter_then_exec(cgroups, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(ready_w, listener.fileno()),
            )
    except BaseException:
        os.close(ready_r)
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()
        raise
    finally:
        # The gateway holds the listener now: when it exits, connections are refused.
        listener.close()
        os.close(ready_w)
        if not isinstance(out, int):
            out.close()
    handle = GatewayHandle(proc, socket_path=socket_path, usage_file=usage_file,
                           log_file=log_file, ready_fd=ready_r, timeout=timeout)  # fmt: skip
    if exit_at is not None:
        leave_unit_cgroup(proc.pid)  # the second line (born there already, see above)
    if wait:
        handle.wait_ready()
    return handle


def _child_env() -> dict[str, str]:
    """The environment a gateway gets (without the upstream key)."""
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # Two malloc arenas, not one per thread (64 MiB of address space each): the
    # gateway runs under RLIMIT_AS, and its threads only write the usage file.
    env["MALLOC_ARENA_MAX"] = "2"
    return env


def start_template() -> Any:
    """A gateway template (:class:`~agentbox.gateway._forkspawn.Template`) started now as
    :func:`spawn_gateway` starts this process's: its environment, born where a task's
    gateway is. For the front end's fork server, whose commands fork their gateways from
    it (:func:`agentbox.gateway._forkspawn.adopt_channel`)."""
    from agentbox.gateway import _forkspawn

    cgroups = [home / "cgroup.procs" for _, home in _gateway_homes()]
    return _forkspawn.Template.start(_child_env(), prefix=enter_then_exec(cgroups, []))


def _fork(
    argv: list[str],
    env: dict[str, str],
    secret_env: dict[str, str],
    listener: socket.socket,
    ready_w: int,
    out: IO[bytes] | int,
    cgroups: list[Path],
    socket_path: Path,
) -> subprocess.Popen[bytes] | None:
    """The gateway forked from this launcher's template (:mod:`._forkspawn`), or None
    (logged) when the template cannot give one: the caller then execs it."""
    from agentbox.gateway import _forkspawn, _template

    forked_argv = [*argv, "--ready-fd", str(_template.READY_FD)]
    null = -1
    try:
        if isinstance(out, int):
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        forked = _forkspawn.fork_gateway(
            argv=forked_argv,
            env={**env, LISTEN_FD_ENV: str(_template.LISTEN_FD)},
            secret_env=secret_env,
            listener=listener.fileno(),
            ready=ready_w,
            log_fd=null if null >= 0 else out.fileno(),  # type: ignore[union-attr]
            cgroups=cgroups,
            template_env=_child_env(),
            prefix=enter_then_exec(cgroups, []),
        )
    except GatewayError as exc:
        log.warning("gateway template failed; starting the gateway by exec", error=str(exc),
                    socket=str(socket_path))  # fmt: skip
        return None
    finally:
        if null >= 0:
            os.close(null)
    log.info("forked gateway", pid=forked.pid, argv=forked_argv, socket=str(socket_path))
    # Not a Popen, but what ServiceHandle uses of one (pid, poll, wait).
    return forked  # type: ignore[return-value]
