"""A live docker sandbox: exec, copy in and out, posture, stop, verified destroy."""

from __future__ import annotations

import contextlib
import io
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from agentbox._log import get_logger
from agentbox.backends._oci_cli import MAX_COPY_OUT, Capture, cgroup_pids, check_env
from agentbox.backends.base import BaseSandbox, ExecResult, OutputCallback, Posture, SandboxSpec
from agentbox.backends.docker._binds import HostBinds
from agentbox.backends.docker._config import exec_argv
from agentbox.backends.docker._exec import exec_stream
from agentbox.errors import AgentboxError, ConfigError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.docker._backend import DockerBackend

__all__ = ["DockerSandbox", "status_of"]

log = get_logger("docker")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an SDK error (404: no such container), None for others."""
    code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


class DockerSandbox(BaseSandbox):
    """A live docker sandbox made by :meth:`DockerBackend.create`."""

    def __init__(self, backend: DockerBackend, spec: SandboxSpec, container_id: str) -> None:
        super().__init__(spec.name)
        self.spec = spec
        self.id = container_id
        self._backend = backend
        self._watchdog = threading.Timer(spec.deadline, self._expire)
        self._watchdog.daemon = True
        self.expired = False
        #: The workspace disk's context (see _wsdisk.py): left after the container.
        self._disk: contextlib.AbstractContextManager[object] | None = None
        #: The hardened bind points of its mounts (see _binds.py): released after it.
        self._binds: HostBinds | None = None

    def _start_watchdog(self) -> None:
        self._watchdog.start()

    def _expire(self) -> None:
        log.warning("sandbox deadline reached; killing", sandbox=self.name)
        self.expired = True
        with contextlib.suppress(AgentboxError):
            self._backend.kill_container(self.id)

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
        """Run ``argv`` as the sandbox uid in its workdir; stream or collect the output.

        With ``timeout``, coreutils ``timeout`` inside the sandbox kills the command
        (closing our end of the stream alone would leave it running inside).
        """
        if not argv:
            raise ConfigError("exec needs a command")
        check_env(env or {})
        inner = list(argv)
        if timeout is not None:
            inner = ["timeout", "--kill-after=2", f"{max(timeout, 0.1):g}", *inner]
        out, err = Capture(on_stdout), Capture(on_stderr)
        started = time.monotonic()
        got = exec_stream(
            self._backend.client,
            self.id,
            exec_argv(self.spec, inner),
            user=f"{self.spec.uid}:{self.spec.uid}",
            workdir=self.spec.workdir,
            env=env,
            stdin=stdin,
            on_stdout=out,
            on_stderr=err,
            timeout=None if timeout is None else timeout + 15,
        )
        if got.gave_up:
            return ExecResult(-1, out.data, err.data, timed_out=True)
        rc = 137 if got.exit_code is None else got.exit_code
        elapsed = time.monotonic() - started
        timed_out = (timeout is not None and rc in (124, 137) and elapsed >= timeout) or (
            self.expired and got.exit_code is None
        )
        return ExecResult(rc, out.data, err.data, timed_out=timed_out)

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy host ``src`` to ``dest``, unpacked by ``tar`` running as the sandbox uid."""
        dest_p = PurePosixPath(dest)
        if not dest_p.is_absolute() or ".." in dest_p.parts or dest_p == PurePosixPath("/"):
            raise ConfigError(f"copy_in destination must be an absolute path: {dest!r:.80}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(src, arcname=dest_p.name)  # links archived as links, never followed
        res = self.exec(["tar", "-x", "--no-same-owner", "-C", str(dest_p.parent), "-f", "-"],
                        stdin=buf.getvalue(), timeout=300)  # fmt: skip
        if res.exit_code != 0:
            raise SandboxError(
                f"copy_in to {dest} failed: {res.stderr.decode(errors='replace')[-500:]}",
                sandbox=self.name,
            )

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy sandbox ``src`` to host ``dest`` without following links out.

        ``tar`` in the sandbox (as its uid) packs it; the host unpacks with tarfile's
        ``data`` filter (absolute names, ``..``, links out, devices skipped and logged).
        The sandbox must be running: no ``/archive`` endpoint is ever called.
        """
        src_p = PurePosixPath(src)
        if not src_p.is_absolute() or ".." in src_p.parts or src_p == PurePosixPath("/"):
            raise ConfigError(f"copy_out source must be an absolute path: {src!r:.80}")
        if dest.exists() or dest.is_symlink():
            raise ConfigError(f"copy_out destination exists: {dest}")
        with tempfile.TemporaryFile() as archive:
            size = 0

            def sink(chunk: bytes) -> None:
                nonlocal size
                size += len(chunk)
                if size > MAX_COPY_OUT:
                    raise SandboxError(f"copy_out of {src}: more than {MAX_COPY_OUT} bytes")
                archive.write(chunk)

            res = self.exec(["tar", "-c", "-C", str(src_p.parent), "-f", "-", "--", src_p.name],
                            on_stdout=sink, timeout=600)  # fmt: skip
            if res.exit_code != 0:
                raise SandboxError(f"copy_out of {src} failed: "
                                   f"{res.stderr.decode(errors='replace')[-400:]}",
                                   sandbox=self.name)  # fmt: skip
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
                    log.warning("copy_out skipped unsafe entries", sandbox=self.name,
                                first=skipped[:5])  # fmt: skip
                got = Path(tmp) / src_p.name
                if not got.exists() and not got.is_symlink():
                    raise SandboxError(f"copy_out: {src} not found", sandbox=self.name)
                got.rename(dest)

    def inspect(self) -> dict[str, Any]:
        """``GET /containers/{id}/json`` (what ``docker inspect`` prints)."""
        try:
            data = self._backend.client.api.inspect_container(self.id)
        except Exception as exc:
            raise SandboxError(f"cannot inspect: {exc}", sandbox=self.name) from exc
        if not isinstance(data, dict):
            raise SandboxError("docker inspect gave no object", sandbox=self.name)
        return data

    def posture(self) -> Posture:
        """Read the live posture: probes inside, ``docker inspect`` and ``/proc`` on the host."""
        from agentbox.backends.docker._posture import read_posture

        return read_posture(self, self._backend.settings, self._backend.facts())

    def host_pids(self) -> list[int]:
        """The container's init pid (``State.Pid``) and the rest of its pids cgroup."""
        state = self.inspect().get("State") or {}
        init = state.get("Pid") if isinstance(state, dict) else 0
        if not isinstance(init, int) or init <= 0:
            raise SandboxError("docker reports no pid for it (not running?)", sandbox=self.name)
        return cgroup_pids(init)

    def stop(self, timeout: float = 10.0) -> None:
        """TERM the sandbox's processes, KILL after ``timeout``; the container is kept."""
        api = self._backend.client.api
        try:
            api.kill(self.id, signal="SIGTERM")
            api.wait(self.id, timeout=max(timeout, 0.1), condition="not-running")
        except Exception as exc:
            if status_of(exc) in (404, 409):  # gone, or not running: stopped already
                return
            with contextlib.suppress(AgentboxError):
                self._backend.kill_container(self.id)

    def _teardown(self) -> None:
        self._watchdog.cancel()
        try:
            self._backend.remove_container(self.id)
        finally:
            binds, self._binds = self._binds, None
            if binds is not None:
                binds.release()
            disk, self._disk = self._disk, None
            if disk is not None:  # copied back and unmounted only once the container is gone
                disk.__exit__(None, None, None)

    def leftovers(self) -> list[str]:
        """The container, if the daemon still has it, and its bind points."""
        binds = HostBinds(self._backend.settings, self.name).leftovers()
        try:
            self._backend.client.api.inspect_container(self.id)
        except Exception as exc:
            if status_of(exc) == 404:
                return binds
            return [f"container {self.name} (inspect: {exc})", *binds]
        return [f"container {self.name}", *binds]
