"""The live OCI-container sandbox podman and docker share.

Everything but the engine call lives here once: the deadline watchdog, exec's
in-sandbox ``timeout`` wrapper and its ``timed_out`` rule, ``copy_in`` (a tar
stream unpacked inside by the sandbox uid), ``copy_out`` (packed by the engine,
unpacked on the host through tarfile's ``data`` filter, bounded by
:data:`~agentbox.backends.oci._cli.MAX_COPY_OUT`), ``host_pids`` from the init
pid's cgroup, the workspace disk settled after the container, the start on that
disk (:func:`start_on_disk`) and the gateway relay's in-sandbox readiness wait.

A subclass supplies the engine's half: :meth:`OciSandbox._run` (one exec),
:meth:`OciSandbox._pack` (tar of a path), :meth:`OciSandbox._init_pid`,
:meth:`OciSandbox._on_deadline`, :meth:`OciSandbox._remove`, and ``stop``,
``posture`` and ``leftovers``. The podman backend drives the ``podman`` CLI,
the docker backend the Engine API through its guarded SDK client.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, ClassVar, TypeVar

from agentbox.backends._wsdisk import workspace_disk
from agentbox.backends.base import (
    GATEWAY_PORT,
    BaseSandbox,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxSpec,
)
from agentbox.backends.oci._cli import MAX_COPY_OUT, Capture, cgroup_pids
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ConfigError, SandboxError

#: What :meth:`OciSandbox._run` gives back: the exit code and whether the sandbox's
#: deadline killed the command; None when the host gave up waiting for it.
Ran = tuple[int, bool] | None


class OciSandbox(BaseSandbox):
    """One live container: the shared part of the podman and docker sandboxes."""

    #: The engine's name, for messages and the log ("podman", "docker").
    engine: ClassVar[str]

    def __init__(self, spec: SandboxSpec, container_id: str) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.id = container_id
        self._watchdog = threading.Timer(spec.deadline, self._expire)
        self._watchdog.daemon = True
        self.expired = False
        #: The workspace disk's context (see _wsdisk.py): left after the container.
        self._disk: contextlib.AbstractContextManager[object] | None = None

    # ------------------------------------------------------------- the engine's half

    def _run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None,
        stdin: bytes | None,
        out: Capture,
        err: Capture,
        timeout: float | None,
    ) -> Ran:
        """Run ``argv`` (already wrapped in ``timeout``) as the sandbox uid in its workdir."""
        raise NotImplementedError

    def _pack(self, src: PurePosixPath, sink: Callable[[bytes], None]) -> None:
        """Feed a tar of ``src`` (links kept as links) to ``sink``; raise if it fails."""
        raise NotImplementedError

    def _init_pid(self) -> int:
        """The host pid of the container's init, 0 or less when it has none."""
        raise NotImplementedError

    def _on_deadline(self) -> None:
        """End the sandbox once its deadline passed (its errors are swallowed)."""
        raise NotImplementedError

    def _remove(self) -> None:
        """Kill and remove the container; raise if it survives."""
        raise NotImplementedError

    # ------------------------------------------------------------- the shared half

    def _start_watchdog(self) -> None:
        self._watchdog.start()

    def _expire(self) -> None:
        self.expired = True
        with contextlib.suppress(AgentboxError):
            self._on_deadline()

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
        (ending only our end of it, the host-side client, would leave it running inside).
        """
        if not argv:
            raise ConfigError("exec needs a command")
        inner = list(argv)
        if timeout is not None:
            inner = ["timeout", "--kill-after=2", f"{max(timeout, 0.1):g}", *inner]
        out, err = Capture(on_stdout), Capture(on_stderr)
        started = time.monotonic()
        ran = self._run(inner, env=env, stdin=stdin, out=out, err=err,
                        timeout=None if timeout is None else timeout + 15)  # fmt: skip
        if ran is None:
            return ExecResult(-1, out.data, err.data, timed_out=True)
        rc, killed = ran
        elapsed = time.monotonic() - started
        timed_out = (timeout is not None and rc in (124, 137) and elapsed >= timeout) or killed
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

        The engine packs ``src`` (:meth:`_pack`: links resolve inside the sandbox's
        own root), at most :data:`MAX_COPY_OUT` bytes. The host unpacks with
        tarfile's ``data`` filter: an entry with an absolute name, ``..``, a link
        pointing outside ``dest`` or a device is skipped (and logged),
        setuid/setgid bits are dropped. ``dest`` must not exist yet.
        """
        src_p = PurePosixPath(src)
        if not src_p.is_absolute() or ".." in src_p.parts or src_p == PurePosixPath("/"):
            raise ConfigError(f"copy_out source must be an absolute path: {src!r:.80}")
        if dest.exists() or dest.is_symlink():
            raise ConfigError(f"copy_out destination exists: {dest}")
        with tempfile.TemporaryFile() as archive:
            self._pack(src_p, _bounded(src_p, archive))
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
                    get_logger(self.engine).warning(
                        "copy_out skipped unsafe entries", sandbox=self.name, first=skipped[:5]
                    )
                got = Path(tmp) / src_p.name
                if not got.exists() and not got.is_symlink():
                    raise SandboxError(f"copy_out: {src} not found", sandbox=self.name)
                got.rename(dest)

    def host_pids(self) -> list[int]:
        """The container's init pid (as the engine reports it) and the rest of its pids cgroup."""
        init = self._init_pid()
        if init <= 0:
            raise SandboxError(
                f"{self.engine} reports no pid for it (not running?)", sandbox=self.name
            )
        return cgroup_pids(init)

    def _teardown(self) -> None:
        """Kill and remove the container, then settle its workspace disk (once; see
        :class:`~agentbox.backends.base.BaseSandbox`)."""
        self._watchdog.cancel()
        self._remove()
        self._settle_disk()

    def _settle_disk(self) -> None:
        disk, self._disk = self._disk, None
        if disk is not None:  # copied back and unmounted only once the container is gone
            disk.__exit__(None, None, None)


def _bounded(src: PurePosixPath, archive: IO[bytes]) -> Callable[[bytes], None]:
    """A sink writing to ``archive`` that raises past :data:`MAX_COPY_OUT` bytes."""
    size = 0

    def sink(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        if size > MAX_COPY_OUT:
            raise SandboxError(f"copy_out of {src}: more than {MAX_COPY_OUT} bytes")
        archive.write(chunk)

    return sink


Box = TypeVar("Box", bound=OciSandbox)


def start_on_disk(
    settings: Settings,
    spec: SandboxSpec,
    start: Callable[[SandboxSpec], Box],
    wait_relay: Callable[[Box], None],
) -> Box:
    """``start(spec)`` on the spec's workspace disk, then wait for its gateway relay.

    The disk is left by the sandbox's destroy, after the container is gone; a
    start that fails leaves it at once, a relay that never listens destroys the
    sandbox.
    """
    disk = workspace_disk(settings, spec)
    disk.__enter__()  # left by the sandbox's destroy, after the container is gone
    try:
        box = start(spec)
    except BaseException:
        disk.__exit__(None, None, None)
        raise
    box._disk = disk
    try:
        if spec.gateway_dir is not None:
            wait_relay(box)
    except BaseException:
        box.destroy()
        raise
    return box


#: Runs inside the sandbox: exit 0 once 127.0.0.1:argv[2] accepts, 1 after argv[1] s.
RELAY_WAIT = r"""
import socket, sys, time
end = time.monotonic() + float(sys.argv[1])
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > end:
            sys.exit(1)
        time.sleep(0.02)
"""


def wait_relay_inside(box: Sandbox, timeout: float = 10.0) -> None:
    """Return once the in-sandbox relay listens on 127.0.0.1:GATEWAY_PORT, asked from inside."""
    res = box.exec(["python3", "-I", "-S", "-c", RELAY_WAIT, str(timeout), str(GATEWAY_PORT)])
    if res.exit_code != 0:
        raise SandboxError("gateway relay did not start listening", sandbox=box.name)
