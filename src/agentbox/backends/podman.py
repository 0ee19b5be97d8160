"""The podman backend: hardened OCI containers under runc, crun or runsc (gVisor).

Every sandbox gets the seed's "Agent container" list (see
:func:`agentbox.backends._podman_args.run_args` for the flags and why each is
there). Two ways to run:

* :meth:`PodmanBackend.run`: one shot, the fastest path (``agentbox exec``, the
  launcher): ``podman run --rm`` with the command as the container's main
  process, stdio passed straight through (``--log-driver passthrough``).
* :meth:`PodmanBackend.create`: a sandbox that idles (``sleep infinity`` under
  tini) until commands are ``podman exec``'d into it.

Deadlines are enforced twice, both outside the caller's event loop: a watchdog
thread kills the container at the deadline, and conmon's own ``--timeout``
kills it a few seconds later even if agentbox itself died. A killed or
timed-out sandbox is removed with ``podman rm -f``; nothing of it survives
(tests/integration/test_podman_cleanup.py proves it).

``unsafe_extra_args`` is appended to ``podman run`` verbatim. It exists ONLY for
the escape suite's positive controls (deliberately weakened sandboxes on which
a probe must fire). No Boxfile key and no normal CLI option reaches it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import IO, Self

import psutil

from agentbox import _proc
from agentbox._log import get_logger
from agentbox.backends._podman_args import (
    CONMON_GRACE,
    check_spec,
    entry_argv,
    forget_image,
    image_facts,
    run_args,
)
from agentbox.backends._podman_posture import read_posture, wait_relay
from agentbox.backends.base import (
    LABEL,
    ExecResult,
    OutputCallback,
    Posture,
    SandboxSpec,
)
from agentbox.config import Settings
from agentbox.errors import (
    AgentboxError,
    CommandError,
    CommandTimeout,
    ConfigError,
    SandboxError,
)

__all__ = ["PodmanBackend", "PodmanSandbox"]

log = get_logger("podman")

#: Output kept in memory per stream when no callback is given; the rest is dropped.
MAX_CAPTURE = 64 * 1024 * 1024
#: copy_out refuses archives bigger than this (the sandbox controls their size).
MAX_COPY_OUT = 4 * 1024**3
_ENV_NAME_OK = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def _check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not name or name[0].isdigit() or not set(name) <= _ENV_NAME_OK or len(name) > 128:
            raise ConfigError(f"not an environment variable name: {name!r:.60}")
        if "\n" in value or "\0" in value:
            raise ConfigError(f"environment variable {name} contains a newline or NUL")


@contextlib.contextmanager
def _env_file(env: Mapping[str, str]) -> Iterator[Path]:
    """Values go to podman through an owner-only file, never on a command line (ps shows it)."""
    _check_env(env)
    with tempfile.TemporaryDirectory(prefix="agentbox-env-") as d:
        path = Path(d) / "env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in env.items())
        yield path


@contextlib.contextmanager
def _stdin_fd(data: bytes | None) -> Iterator[int]:
    if data is None:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        yield f.fileno()


class _Capture:
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


def _force_remove(name: str, attempts: int = 5) -> None:
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


def _podman_error(tail: bytes) -> bool:
    """Whether stderr ends with podman's own error (the command never ran)."""
    return tail.startswith(b"Error: ") or b"\nError: " in tail


def _kill(name: str) -> None:
    with contextlib.suppress(AgentboxError):
        _proc.run(["podman", "kill", "--signal", "KILL", name], timeout=30, check=False)


def _owner_start() -> str:
    return f"{psutil.Process().create_time():.0f}"


class PodmanSandbox:
    """A live podman sandbox made by :meth:`PodmanBackend.create`."""

    def __init__(self, backend: PodmanBackend, spec: SandboxSpec, container_id: str) -> None:
        self.name = spec.name
        self.spec = spec
        self.id = container_id
        self._backend = backend
        self._destroyed = False
        self._lock = threading.Lock()
        self._watchdog = threading.Timer(spec.deadline, self._expire)
        self._watchdog.daemon = True
        self.expired = False

    def _start_watchdog(self) -> None:
        self._watchdog.start()

    def _expire(self) -> None:
        log.warning("sandbox deadline reached; destroying", sandbox=self.name)
        self.expired = True
        with contextlib.suppress(AgentboxError):
            self.destroy()

    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``argv`` as the sandbox uid in the sandbox's workdir; stream or collect output.

        With ``timeout``, coreutils ``timeout`` inside the sandbox kills the command
        (killing only the host-side ``podman exec`` would leave it running inside).
        """
        if not argv:
            raise ConfigError("exec needs a command")
        uid = self.spec.uid
        inner = list(argv)
        if timeout is not None:
            inner = ["timeout", "--kill-after=2", f"{max(timeout, 0.1):g}", *inner]
        out, err = _Capture(on_stdout), _Capture(on_stderr)
        with _env_file(env or {}) as envf, _stdin_fd(stdin) as fd:
            args = ["podman", "exec"] + (["-i"] if stdin is not None else [])
            args += ["--user", f"{uid}:{uid}", "--workdir", self.spec.workdir]
            args += ["--env-file", str(envf), self.name, *inner]
            started = time.monotonic()
            try:
                rc = _proc.stream(
                    args,
                    on_stdout=out,
                    on_stderr=err,
                    timeout=None if timeout is None else timeout + 15,
                    stdin=fd,
                )
            except CommandTimeout:
                return ExecResult(-1, out.data, err.data, timed_out=True)
        if rc in (125, 126, 127) and _podman_error(err.tail):
            raise SandboxError(
                f"podman exec failed: {err.tail.decode(errors='replace').strip()}",
                sandbox=self.name,
            )
        elapsed = time.monotonic() - started
        timed_out = timeout is not None and rc in (124, 137) and elapsed >= timeout
        return ExecResult(rc, out.data, err.data, timed_out=timed_out)

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy host ``src`` to ``dest`` in the sandbox, unpacked *by the sandbox uid*.

        A tar stream is unpacked by ``tar`` running inside the sandbox, so it can
        only write where the sandbox itself may, and files belong to the sandbox
        uid. (``podman cp`` cannot write into a tmpfs under a user namespace.)
        """
        dest_p = PurePosixPath(dest)
        if not dest_p.is_absolute() or ".." in dest_p.parts or dest_p == PurePosixPath("/"):
            raise ConfigError(f"copy_in destination must be an absolute path: {dest!r:.80}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(src, arcname=dest_p.name)  # links archived as links, never followed
        res = self.exec(
            ["tar", "-x", "--no-same-owner", "-C", str(dest_p.parent), "-f", "-"],
            stdin=buf.getvalue(),
            timeout=300,
        )
        if res.exit_code != 0:
            raise SandboxError(
                f"copy_in to {dest} failed: {res.stderr.decode(errors='replace')[-500:]}",
                sandbox=self.name,
            )

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy sandbox ``src`` to host ``dest`` without following links out.

        The sandbox packs ``src`` with ``tar`` (running as the sandbox uid, links
        resolve inside its own root); a stopped sandbox is packed by
        ``podman cp`` (which resolves inside the container's root). The host
        unpacks with tarfile's ``data`` filter: an entry with an absolute name,
        ``..``, a link pointing outside ``dest`` or a device is skipped (and
        logged), setuid/setgid bits are dropped. ``dest`` must not exist yet.
        """
        src_p = PurePosixPath(src)
        if not src_p.is_absolute() or ".." in src_p.parts or src_p == PurePosixPath("/"):
            raise ConfigError(f"copy_out source must be an absolute path: {src!r:.80}")
        if dest.exists() or dest.is_symlink():
            raise ConfigError(f"copy_out destination exists: {dest}")
        with tempfile.TemporaryFile() as archive:
            self._pack(src_p, archive)
            archive.seek(0)
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".agentbox-copy-") as tmp:
                skipped: list[str] = []

                def safe(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
                    try:
                        return tarfile.data_filter(member, path)
                    except tarfile.FilterError:
                        skipped.append(member.name[:200])
                        return None

                try:
                    with tarfile.open(fileobj=archive, mode="r:") as tar:
                        tar.extractall(tmp, filter=safe)  # noqa: S202 (filtered: data_filter)
                except (tarfile.TarError, OSError) as exc:
                    raise SandboxError(f"copy_out of {src}: {exc}", sandbox=self.name) from exc
                if skipped:
                    log.warning(
                        "copy_out skipped unsafe entries", sandbox=self.name, first=skipped[:5]
                    )
                got = Path(tmp) / src_p.name
                if not got.exists() and not got.is_symlink():
                    raise SandboxError(f"copy_out: {src} not found", sandbox=self.name)
                got.rename(dest)

    def _pack(self, src: PurePosixPath, archive: IO[bytes]) -> None:
        size = 0

        def sink(chunk: bytes) -> None:
            nonlocal size
            size += len(chunk)
            if size > MAX_COPY_OUT:
                raise SandboxError(f"copy_out of {src}: more than {MAX_COPY_OUT} bytes")
            archive.write(chunk)

        errs = _Capture(None)
        if self._running():
            args = ["podman", "exec", "--user", f"{self.spec.uid}:{self.spec.uid}", self.name]
            args += ["tar", "-c", "-C", str(src.parent), "-f", "-", "--", src.name]
        else:
            args = ["podman", "cp", f"{self.name}:{src}", "-"]
        rc = _proc.stream(args, on_stdout=sink, on_stderr=errs, timeout=600)
        if rc != 0:
            raise SandboxError(
                f"copy_out of {src} failed: {errs.tail.decode(errors='replace').strip()}",
                sandbox=self.name,
            )

    def _running(self) -> bool:
        res = _proc.run(
            ["podman", "inspect", "--format", "{{.State.Running}}", self.name],
            timeout=30,
            check=False,
        )
        return res.stdout.strip() == "true"

    def posture(self) -> Posture:
        """Read the live posture: probes inside, ``podman inspect`` and ``/proc`` on the host."""
        return read_posture(self, self._backend.settings)

    def stop(self, timeout: float = 10.0) -> None:
        """TERM the sandbox's processes, KILL after ``timeout``; the container is kept."""
        try:
            _proc.run(
                ["podman", "stop", "--ignore", "--time", str(max(0, int(timeout))), self.name],
                timeout=timeout + 60,
            )
        except CommandError as exc:
            raise SandboxError(f"could not stop: {exc}", sandbox=self.name) from exc

    def destroy(self) -> None:
        """Kill and remove the container (idempotent); nothing of it is left on the host."""
        with self._lock:
            if self._destroyed:
                return
            self._watchdog.cancel()
            _force_remove(self.name)
            self._destroyed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()


class PodmanBackend:
    """Hardened podman containers; see the module docstring.

    ``unsafe_extra_args`` weakens every sandbox this backend makes; it is for
    the escape suite's positive controls only and is not reachable from a
    Boxfile or the normal CLI.
    """

    name = "podman"

    def __init__(self, settings: Settings, *, unsafe_extra_args: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.unsafe_extra_args = tuple(unsafe_extra_args)
        if self.unsafe_extra_args:
            log.warning("podman backend weakened on purpose", extra=self.unsafe_extra_args)

    def check(self, spec: SandboxSpec) -> None:
        """Refuse ``spec`` before anything starts: runtime, image, mounts, uid."""
        check_spec(spec, subid_base=self.settings.subid_base)

    def _labels(self, spec: SandboxSpec) -> SandboxSpec:
        labels = {LABEL: "1", **spec.labels, "io.agentbox.owner-start": _owner_start()}
        return spec.replace(labels=labels)

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """One shot: a fresh container runs ``argv`` as its main command, then is removed."""
        if not argv:
            raise ConfigError("run needs a command")
        facts = check_spec(spec, subid_base=self.settings.subid_base)
        assert facts is not None
        spec = self._labels(spec)
        out, err = _Capture(on_stdout), _Capture(on_stderr)
        fired = threading.Event()

        def expire() -> None:
            fired.set()
            _kill(spec.name)

        watchdog = threading.Timer(spec.deadline, expire)
        watchdog.daemon = True
        rc: int | None = None
        started = time.monotonic()
        try:
            with _env_file(spec.env) as envf, _stdin_fd(stdin) as fd:
                args = run_args(
                    spec,
                    self.settings,
                    facts,
                    detach=False,
                    env_file=envf,
                    interactive=stdin is not None,
                    unsafe_extra_args=self.unsafe_extra_args,
                )
                args += entry_argv(spec, argv)
                watchdog.start()
                try:
                    rc = _proc.stream(
                        args,
                        on_stdout=out,
                        on_stderr=err,
                        timeout=spec.deadline + CONMON_GRACE + 30,
                        stdin=fd,
                    )
                except CommandTimeout:
                    fired.set()
        finally:
            watchdog.cancel()
            # --rm removes the container on a normal exit; after a kill, a timeout or an
            # error (ours or podman's) make sure nothing is left.
            if rc is None or fired.is_set() or rc >= 125:
                _force_remove(spec.name)
        timed_out = fired.is_set() or (
            rc in (137, 255) and time.monotonic() - started >= spec.deadline
        )
        if rc in (125, 126, 127) and _podman_error(err.tail):
            self._raise_start_error(spec, err.tail)
        return ExecResult(rc if rc is not None else -1, out.data, err.data, timed_out=timed_out)

    def _raise_start_error(self, spec: SandboxSpec, tail: bytes) -> None:
        msg = tail.decode(errors="replace").strip()
        forget_image(spec.image)
        image_facts(spec.image, refresh=True)  # raises ImageError if it vanished
        raise SandboxError(f"podman could not start it: {msg}", sandbox=spec.name)

    def create(self, spec: SandboxSpec) -> PodmanSandbox:
        """Start a sandbox idling under tini; ``exec`` commands into it; ``destroy`` it."""
        facts = check_spec(spec, subid_base=self.settings.subid_base)
        assert facts is not None
        spec = self._labels(spec)
        with _env_file(spec.env) as envf:
            args = run_args(
                spec,
                self.settings,
                facts,
                detach=True,
                env_file=envf,
                unsafe_extra_args=self.unsafe_extra_args,
            )
            args += entry_argv(spec, ["sleep", "infinity"])
            try:
                res = _proc.run(args, timeout=120)
            except CommandError as exc:
                with contextlib.suppress(AgentboxError):
                    _force_remove(spec.name)
                if "image not known" in exc.stderr:
                    forget_image(spec.image)
                    image_facts(spec.image, refresh=True)
                raise SandboxError(f"could not start: {exc}", sandbox=spec.name) from exc
        box = PodmanSandbox(self, spec, res.stdout.strip())
        box._start_watchdog()
        try:
            if spec.gateway_dir is not None:
                wait_relay(box)
        except BaseException:
            box.destroy()
            raise
        return box

    def interactive(self, spec: SandboxSpec, argv: Sequence[str]) -> int:
        """``podman run -it`` with the same hardening, on this terminal; returns the exit code.

        The one place that does not go through ``agentbox._proc``: the child
        must own the terminal.
        """
        facts = check_spec(spec, subid_base=self.settings.subid_base)
        assert facts is not None
        spec = self._labels(spec)
        with _env_file(spec.env) as envf:
            args = run_args(
                spec,
                self.settings,
                facts,
                detach=False,
                env_file=envf,
                interactive=True,
                tty=os.isatty(0),
                unsafe_extra_args=self.unsafe_extra_args,
            )
            # A terminal needs conmon in the middle (passthrough cannot carry a tty).
            i = args.index("passthrough")
            args[i - 1 : i + 1] = []
            args += entry_argv(spec, argv)
            log.debug("interactive", argv=args)
            try:
                return subprocess.call(args)
            finally:
                _force_remove(spec.name)

    def list_sandboxes(self) -> list[dict[str, object]]:
        """Every container labelled as an agentbox sandbox (running or not)."""
        res = _proc.run(
            ["podman", "ps", "-a", "--filter", f"label={LABEL}=1", "--format", "json"],
            timeout=60,
        )
        try:
            data = json.loads(res.stdout or "[]")
        except json.JSONDecodeError as exc:
            raise SandboxError(f"podman ps gave no JSON: {exc}") from exc
        return [d for d in data if isinstance(d, dict)]

    def cleanup_orphans(self) -> list[str]:
        """Remove labelled containers whose owner process is gone; return their names."""
        removed = []
        for c in self.list_sandboxes():
            labels = c.get("Labels") or {}
            names = c.get("Names") or []
            if not isinstance(labels, dict) or not isinstance(names, list) or not names:
                continue
            if _owner_alive(labels):
                continue
            name = str(names[0])
            log.info("removing orphan sandbox", sandbox=name)
            _force_remove(name)
            removed.append(name)
        return removed


def _owner_alive(labels: Mapping[str, object]) -> bool:
    try:
        pid = int(str(labels.get("io.agentbox.owner-pid", "")))
        start = str(labels.get("io.agentbox.owner-start", ""))
        proc = psutil.Process(pid)
        return f"{proc.create_time():.0f}" == start
    except (ValueError, psutil.Error):
        return False
