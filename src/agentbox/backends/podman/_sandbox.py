"""A live podman sandbox: the ``podman`` CLI's half of
:class:`~agentbox.backends.oci._sandbox.OciSandbox` (exec, pack, pid, stop, remove)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from agentbox.backends.base import Posture, SandboxSpec
from agentbox.backends.oci._cli import (
    Capture,
    conmon_cwd,
    env_file,
    force_remove,
    podman_error,
    stdin_fd,
)
from agentbox.backends.oci._posture import read_posture
from agentbox.backends.oci._sandbox import OciSandbox, Ran
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import CommandError, CommandTimeout, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.podman import PodmanBackend

log = get_logger(__name__)


class PodmanSandbox(OciSandbox):
    """A live podman sandbox made by :meth:`PodmanBackend.create`."""

    engine = "podman"

    def __init__(self, backend: PodmanBackend, spec: SandboxSpec, container_id: str) -> None:
        super().__init__(spec, container_id)
        self._backend = backend

    def _on_deadline(self) -> None:
        log.warning("sandbox deadline reached; destroying", sandbox=self.name)
        self.destroy()

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
        """``podman exec`` (its env in a sealed memfd, see ``env_file``)."""
        uid = self.spec.uid
        with env_file(env or {}) as envf, stdin_fd(stdin) as fd:
            args = ["podman", "exec"] + (["-i"] if stdin is not None else [])
            args += ["--user", f"{uid}:{uid}", "--workdir", self.spec.workdir]
            args += ["--env-file", str(envf.path), self.name, *argv]
            try:
                rc = _proc.stream(
                    args,
                    on_stdout=out,
                    on_stderr=err,
                    timeout=timeout,
                    stdin=fd,
                    cwd=conmon_cwd(),
                )
            except CommandTimeout:
                return None
        if rc in (125, 126, 127) and podman_error(err.tail):
            raise SandboxError(
                f"podman exec failed: {err.tail.decode(errors='replace').strip()}",
                sandbox=self.name,
            )
        return rc, False

    def _pack(self, src: PurePosixPath, sink: Callable[[bytes], None]) -> None:
        """``tar`` in the sandbox as its uid; a stopped sandbox: ``podman cp`` (which
        resolves inside the container's root)."""
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

    def _init_pid(self) -> int:
        """``podman inspect``'s ``State.Pid``."""
        res = _proc.run(
            ["podman", "inspect", "--format", "{{.State.Pid}}", self.name], timeout=30, check=False
        )
        try:
            return int(res.stdout.strip() or "0")
        except ValueError:
            return 0

    def stop(self, timeout: float = 10.0) -> None:
        """TERM the sandbox's processes, KILL after ``timeout``; the container is kept."""
        try:
            _proc.run(
                ["podman", "stop", "--ignore", "--time", str(max(0, int(timeout))), self.name],
                timeout=timeout + 60,
            )
        except CommandError as exc:
            raise SandboxError(f"could not stop: {exc}", sandbox=self.name) from exc

    def _remove(self) -> None:
        force_remove(self.name)

    def leftovers(self) -> list[str]:
        """The container, if podman still knows it."""
        res = _proc.run(["podman", "container", "exists", self.name], timeout=60, check=False)
        return ["the container"] if res.returncode == 0 else []
