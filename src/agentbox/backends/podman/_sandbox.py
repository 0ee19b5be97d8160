"""A live podman sandbox: exec, copy in and out, posture, stop, destroy."""

from __future__ import annotations

import contextlib
import io
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING

from agentbox import _proc
from agentbox._log import get_logger
from agentbox.backends._oci_cli import (
    MAX_COPY_OUT,
    Capture,
    cgroup_pids,
    conmon_cwd,
    env_file,
    force_remove,
    podman_error,
    stdin_fd,
)
from agentbox.backends._oci_posture import read_posture
from agentbox.backends.base import BaseSandbox, ExecResult, OutputCallback, Posture, SandboxSpec
from agentbox.errors import AgentboxError, CommandError, CommandTimeout, ConfigError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.podman import PodmanBackend

__all__ = ["PodmanSandbox"]

log = get_logger("podman")


class PodmanSandbox(BaseSandbox):
    """A live podman sandbox made by :meth:`PodmanBackend.create`."""

    def __init__(self, backend: PodmanBackend, spec: SandboxSpec, container_id: str) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.id = container_id
        self._backend = backend
        self._watchdog = threading.Timer(spec.deadline, self._expire)
        self._watchdog.daemon = True
        self.expired = False
        #: The workspace disk's context (see _wsdisk.py): left after the container.
        self._disk: contextlib.AbstractContextManager[object] | None = None

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
        out, err = Capture(on_stdout), Capture(on_stderr)
        with env_file(env or {}) as envf, stdin_fd(stdin) as fd:
            args = ["podman", "exec"] + (["-i"] if stdin is not None else [])
            args += ["--user", f"{uid}:{uid}", "--workdir", self.spec.workdir]
            args += ["--env-file", str(envf.path), self.name, *inner]
            started = time.monotonic()
            try:
                rc = _proc.stream(
                    args,
                    on_stdout=out,
                    on_stderr=err,
                    timeout=None if timeout is None else timeout + 15,
                    stdin=fd,
                    cwd=conmon_cwd(),
                )
            except CommandTimeout:
                return ExecResult(-1, out.data, err.data, timed_out=True)
        if rc in (125, 126, 127) and podman_error(err.tail):
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

        errs = Capture(None)
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

    def host_pids(self) -> list[int]:
        """The container's init pid (from ``podman inspect``) and the rest of its pids cgroup."""
        res = _proc.run(
            ["podman", "inspect", "--format", "{{.State.Pid}}", self.name], timeout=30, check=False
        )
        try:
            init = int(res.stdout.strip() or "0")
        except ValueError:
            init = 0
        if init <= 0:
            raise SandboxError("podman reports no pid for it (not running?)", sandbox=self.name)
        return cgroup_pids(init)

    def stop(self, timeout: float = 10.0) -> None:
        """TERM the sandbox's processes, KILL after ``timeout``; the container is kept."""
        try:
            _proc.run(
                ["podman", "stop", "--ignore", "--time", str(max(0, int(timeout))), self.name],
                timeout=timeout + 60,
            )
        except CommandError as exc:
            raise SandboxError(f"could not stop: {exc}", sandbox=self.name) from exc

    def _teardown(self) -> None:
        """Kill and remove the container, then settle its workspace disk (once; see
        :class:`~agentbox.backends.base.BaseSandbox`)."""
        self._watchdog.cancel()
        force_remove(self.name)
        disk, self._disk = self._disk, None
        if disk is not None:  # copied back and unmounted only once the container is gone
            disk.__exit__(None, None, None)

    def leftovers(self) -> list[str]:
        """The container, if podman still knows it."""
        res = _proc.run(["podman", "container", "exists", self.name], timeout=60, check=False)
        return ["the container"] if res.returncode == 0 else []
