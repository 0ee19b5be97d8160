"""A live docker sandbox: the Engine API's half of
:class:`~agentbox.backends.oci._sandbox.OciSandbox` (exec, pack, pid, stop, remove)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from agentbox.backends.base import Posture, SandboxSpec
from agentbox.backends.docker._binds import HostBinds
from agentbox.backends.docker._config import exec_argv
from agentbox.backends.docker._exec import exec_stream
from agentbox.backends.oci._cli import Capture, check_env
from agentbox.backends.oci._sandbox import OciSandbox, Ran
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.docker._backend import DockerBackend

log = get_logger(__name__)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an SDK error (404: no such container), None for others."""
    code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


class DockerSandbox(OciSandbox):
    """A live docker sandbox made by :meth:`DockerBackend.create`."""

    engine = "docker"

    def __init__(self, backend: DockerBackend, spec: SandboxSpec, container_id: str) -> None:
        super().__init__(spec, container_id)
        self._backend = backend
        #: The hardened bind points of its mounts (see _binds.py): released after it.
        self._binds: HostBinds | None = None

    def _on_deadline(self) -> None:
        log.warning("sandbox deadline reached; killing", sandbox=self.name)
        self._backend.kill_container(self.id)

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
        """An Engine exec (``exec_stream``); one the deadline killed has no exit code."""
        check_env(env or {})
        got = exec_stream(
            self._backend.client,
            self.id,
            exec_argv(self.spec, argv),
            user=f"{self.spec.uid}:{self.spec.uid}",
            workdir=self.spec.workdir,
            env=env,
            stdin=stdin,
            on_stdout=out,
            on_stderr=err,
            timeout=timeout,
        )
        if got.gave_up:
            return None
        rc = 137 if got.exit_code is None else got.exit_code
        return rc, self.expired and got.exit_code is None

    def _pack(self, src: PurePosixPath, sink: Callable[[bytes], None]) -> None:
        """``tar`` in the sandbox as its uid. The sandbox must be running: no
        ``/archive`` endpoint is ever called."""
        res = self.exec(["tar", "-c", "-C", str(src.parent), "-f", "-", "--", src.name],
                        on_stdout=sink, timeout=600)  # fmt: skip
        if res.exit_code != 0:
            raise SandboxError(f"copy_out of {src} failed: "
                               f"{res.stderr.decode(errors='replace')[-400:]}",
                               sandbox=self.name)  # fmt: skip

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

    def _init_pid(self) -> int:
        """``State.Pid`` of ``docker inspect``."""
        state = self.inspect().get("State") or {}
        init = state.get("Pid") if isinstance(state, dict) else 0
        return init if isinstance(init, int) else 0

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

    def _remove(self) -> None:
        """Remove the container; its bind points and workspace disk go even if that fails."""
        try:
            self._backend.remove_container(self.id)
        finally:
            binds, self._binds = self._binds, None
            if binds is not None:
                binds.release()
            self._settle_disk()

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
