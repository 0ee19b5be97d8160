"""An in-process backend for tests: scriptable exit codes, output, delays and failures.

:class:`FakeBackend` implements the whole :class:`~agentbox.backends.base.Backend`
Protocol without starting anything: a "sandbox" is an object in this process,
its workspace is the spec's host directory, and a command does what its
:class:`FakeScript` says (write files into the workspace, print, wait, exit
with a code, or fail). Like httpx's ``MockTransport``, it lets the layers above
the backend (the launcher's task lifecycle: status transitions, cancel, the
deadline, the budget, reconcile, publishing) be tested in milliseconds; the
real backends keep their own contract and end-to-end tests.

Scripts are set on the class, because callers build their backend by name
(``get_backend("fake", settings)``) in code the test does not hold::

    with FakeBackend.scripted(FakeScript(exit_code=0, files={"a.txt": b"hi\\n"})):
        launcher.submit(...)

Code that builds the backend a Boxfile names gets the fake inside
``FakeBackend.installed_as("podman")``. A script can match one sandbox by name
(``scripted(script, name=...)``); the newest matching script wins.
:data:`FakeBackend.events` records every verb called, for assertions.
``kill(name)`` from any thread (a cancel, a watchdog in this process) ends the
sandbox's running command with exit 137, as a real backend's SIGKILL does.

Detached sandboxes (``launch``/``follow``/``adoptable``) are in
:mod:`agentbox.backends._fake_detach`: a second ``FakeBackend`` on the same data
dir adopts and follows what a first one launched (a launcher restart, in process).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import ClassVar, Literal

from agentbox.backends._attached import NoPool
from agentbox.backends._fake_detach import FakeDetached
from agentbox.backends.base import (
    WORKSPACE_IN_SANDBOX,
    BackendKind,
    BaseSandbox,
    ExecResult,
    Exited,
    OutputCallback,
    Posture,
    PostureCheck,
    SandboxSpec,
)
from agentbox.config import Settings
from agentbox.errors import AgentboxError, PathRefused, SandboxError

__all__ = ["FakeBackend", "FakeSandbox", "FakeScript", "Verb"]

#: Where a script can make the backend fail.
Verb = Literal["check", "create", "exec", "destroy", "kill", "reap", "recover", "launch", "follow"]
#: The exit code of a killed command (128 + SIGKILL), as every real backend reports it.
KILLED = 137


@dataclass(frozen=True)
class FakeScript:
    """What a command in a fake sandbox does, in order: ``action``, ``files``, output, wait.

    ``files`` (workspace-relative path → bytes, or None to delete) are written into
    the spec's workspace; ``stdout``/``stderr`` go to the callbacks (or the result);
    ``delay`` seconds are then waited, cut short by a kill (exit 137) or the spec's
    deadline (exit 137, ``timed_out``). ``fail`` names verbs that raise ``error``
    (a :class:`~agentbox.errors.SandboxError` by default) instead of acting.
    """

    exit_code: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    delay: float = 0.0
    files: Mapping[str, bytes | None] = field(default_factory=dict)
    fail: frozenset[Verb] = frozenset()
    error: Callable[[str], AgentboxError] | None = None
    action: Callable[[FakeSandbox, Sequence[str]], None] | None = None
    """Runs first, on the caller's thread: anything a test needs the "agent" to do."""

    def raise_if(self, verb: Verb, sandbox: str) -> None:
        if verb in self.fail:
            make = self.error or (lambda what: SandboxError(what, sandbox=sandbox))
            raise make(f"scripted failure of {verb}")


class FakeSandbox(BaseSandbox):
    """A sandbox that lives in this process; its workspace is the spec's host directory."""

    def __init__(self, backend: FakeBackend, spec: SandboxSpec, script: FakeScript) -> None:
        super().__init__(spec.name)
        self.backend = backend
        self.spec = spec
        self.script = script
        self.killed = threading.Event()
        self._wake = threading.Event()
        self._skipped = 0.0
        self.commands: list[list[str]] = []
        self.started = time.monotonic()
        #: Launched detached (``FakeBackend.launch``): how it ended, set when ``done`` is.
        self.detached = False
        self.exited: Exited | None = None
        self.done = threading.Event()

    # -- Sandbox Protocol

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
        """Do what the script says; a kill or the deadline ends the wait with exit 137."""
        del env, stdin
        if self.destroyed:
            raise SandboxError("exec in a destroyed sandbox", sandbox=self.name)
        self.script.raise_if("exec", self.name)
        self.commands.append(list(argv))
        FakeBackend.record("exec", self.name)
        if self.killed.is_set():
            return ExecResult(KILLED)
        if self.script.action is not None:
            self.script.action(self, argv)
        for rel, data in self.script.files.items():
            self._write(rel, data)
        begun = time.monotonic()
        self._skipped = 0.0
        out, err = self.script.stdout, self.script.stderr
        if on_stdout is not None and out:
            on_stdout(out)
            out = b""
        if on_stderr is not None and err:
            on_stderr(err)
            err = b""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            # The fake's clock: real time since the start, plus what advance() added.
            elapsed = time.monotonic() - self.started
            to_deadline = self.spec.deadline - elapsed
            to_done = self.script.delay - (time.monotonic() - begun) - self._skipped
            to_timeout = math.inf if end is None else end - time.monotonic()
            if self.killed.is_set():
                return ExecResult(KILLED, out, err)
            if to_deadline <= 0 or to_timeout <= 0:
                self.killed.set()
                return ExecResult(KILLED, out, err, timed_out=True)
            if to_done <= 0:
                return ExecResult(self.script.exit_code, out, err)
            self._wake.wait(min(to_deadline, to_done, to_timeout))
            self._wake.clear()

    def advance(self, seconds: float) -> None:
        """Move this sandbox's clock on: a deadline or a delay passes without a test
        waiting for it."""
        self.started -= seconds
        self._skipped += seconds
        self._wake.set()

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy a host file into the workspace (only ``/workspace/...`` exists here)."""
        self._write(self._rel(dest), src.read_bytes())

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy a workspace file out to ``dest``."""
        dest.write_bytes(self._host(self._rel(src)).read_bytes())

    def posture(self) -> Posture:
        """Honest: an in-process fake isolates nothing, so its posture is never ok."""
        check = PostureCheck("isolation", "a sandbox", "none (in-process fake)", ok=False)
        return Posture("fake", "none", (check,))

    def host_pids(self) -> list[int]:
        """None: a fake sandbox runs no process of its own."""
        if self.destroyed or self.killed.is_set():
            raise SandboxError("not running", sandbox=self.name)
        return []

    def stop(self, timeout: float = 10.0) -> None:
        """End the running command (as a KILL would); the workspace is kept."""
        del timeout
        self.kill_now()

    def kill_now(self) -> None:
        """End the running command with exit 137 (what ``Backend.kill`` does)."""
        self.killed.set()
        self._wake.set()

    def _teardown(self) -> None:
        self.kill_now()
        self.script.raise_if("destroy", self.name)
        FakeBackend.record("destroy", self.name)
        FakeBackend.forget(self)

    def leftovers(self) -> list[str]:
        """The sandbox itself, while the backend still lists it as live."""
        return [f"live sandbox {self.name}"] if FakeBackend.live(self.name) is self else []

    # -- the workspace

    def _rel(self, path: str) -> str:
        p = PurePosixPath(path)
        if p.is_absolute():
            if not p.is_relative_to(WORKSPACE_IN_SANDBOX):
                raise PathRefused("the fake sandbox has only its workspace", path=path)
            p = p.relative_to(WORKSPACE_IN_SANDBOX)
        return str(p)

    def _host(self, rel: str) -> Path:
        if self.spec.workspace is None:
            raise SandboxError("no workspace", sandbox=self.name)
        parts = PurePosixPath(rel).parts
        if not parts or any(x in ("..", "") for x in parts):
            raise PathRefused("not a path inside the workspace", path=rel)
        return self.spec.workspace.joinpath(*parts)

    def _write(self, rel: str, data: bytes | None) -> None:
        target = self._host(rel)
        if data is None:
            target.unlink(missing_ok=True)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


class FakeBackend(FakeDetached, NoPool):
    """The in-process backend (``name = "fake"``); see the module docstring."""

    name = "fake"
    kind: BackendKind = "process"
    runtimes: tuple[str, ...] = ()
    snapshots = False
    environments_refused: str | None = "its sandboxes are scripted: no image, no mounts"

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _scripts: ClassVar[list[tuple[str | None, FakeScript]]] = []
    _live: ClassVar[dict[str, FakeSandbox]] = {}
    #: (verb, sandbox name) of every call, in order; cleared by :meth:`reset`.
    events: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, settings: Settings, **kw: object) -> None:
        """``kw`` (``cold`` …) is accepted and ignored, as the CLI passes it to any backend."""
        del kw
        self.settings = settings

    # -- scripting (class level: callers build their own instance by name)

    @classmethod
    @contextlib.contextmanager
    def scripted(cls, script: FakeScript, *, name: str | None = None) -> Iterator[FakeScript]:
        """Use ``script`` for new sandboxes (named ``name``, or any) inside the block."""
        entry = (name, script)
        with cls._lock:
            cls._scripts.append(entry)
        try:
            yield script
        finally:
            with cls._lock, contextlib.suppress(ValueError):
                cls._scripts.remove(entry)

    @classmethod
    @contextlib.contextmanager
    def installed_as(cls, name: str) -> Iterator[None]:
        """Register the fake under ``name`` too (``"podman"``: what a default Boxfile asks)
        inside the block, so code that builds its backend by name gets the fake."""
        from agentbox import backends

        before = backends.BACKENDS.get(name)
        backends.BACKENDS[name] = f"{__name__}:{cls.__name__}"
        try:
            yield
        finally:
            if before is None:
                backends.BACKENDS.pop(name, None)
            else:
                backends.BACKENDS[name] = before

    @classmethod
    def script_for(cls, name: str) -> FakeScript:
        with cls._lock:
            for want, script in reversed(cls._scripts):
                if want is None or want == name:
                    return script
        return FakeScript()

    @classmethod
    def record(cls, verb: str, name: str) -> None:
        with cls._lock:
            cls.events.append((verb, name))

    @classmethod
    def live(cls, name: str) -> FakeSandbox | None:
        """The live sandbox called ``name``, if any."""
        with cls._lock:
            return cls._live.get(name)

    @classmethod
    def live_names(cls) -> list[str]:
        with cls._lock:
            return sorted(cls._live)

    @classmethod
    def forget(cls, sandbox: FakeSandbox) -> None:
        with cls._lock:
            if cls._live.get(sandbox.name) is sandbox:
                del cls._live[sandbox.name]

    @classmethod
    def reset(cls) -> None:
        """Forget every script and event; kill and forget every live sandbox."""
        with cls._lock:
            boxes = list(cls._live.values())
            cls._live.clear()
            cls._scripts.clear()
            cls.events.clear()
        for box in boxes:
            box.kill_now()

    # -- Backend Protocol

    def shares_host_kernel(self, runtime: str) -> bool:
        """Everything runs in this very process, on the host's kernel."""
        del runtime
        return True

    def bind_source_uid(self, runtime: str) -> int | None:
        """None: nothing opens the workspace but this process."""
        del runtime
        return None

    def warm(self, image: str) -> None:
        """Nothing to look up; recorded in :attr:`events` as ``("warm", image)``."""
        self.record("warm", image)

    def check(self, spec: SandboxSpec) -> None:
        """Refuse only what the script says (and a workspace that is not a directory)."""
        self.script_for(spec.name).raise_if("check", spec.name)
        if spec.workspace is not None and not spec.workspace.is_dir():
            raise SandboxError(f"no workspace directory {spec.workspace}", sandbox=spec.name)

    def create(self, spec: SandboxSpec) -> FakeSandbox:
        """A live fake sandbox; a name already live is refused, as podman refuses it."""
        script = self.script_for(spec.name)
        self.check(spec)
        script.raise_if("create", spec.name)
        box = FakeSandbox(self, spec, script)
        with self._lock:
            if spec.name in self._live:
                raise SandboxError("a sandbox of that name is live", sandbox=spec.name)
            self._live[spec.name] = box
            self.events.append(("create", spec.name))
        return box

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """create, exec ``argv``, destroy: the one-shot path the launcher takes."""
        with self.create(spec) as box:
            return box.exec(argv, stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr)

    def kill(self, name: str) -> list[str]:
        """End the running command of ``name`` (exit 137); absent is fine."""
        self.script_for(name).raise_if("kill", name)
        self.record("kill", name)
        box = self.live(name)
        if box is None:
            return []
        box.kill_now()
        return [name]

    def reap(self, name: str) -> list[str]:
        """Kill and remove ``name`` (its workspace is the host directory: nothing to save)."""
        self.script_for(name).raise_if("reap", name)
        self.record("reap", name)
        self._drop_record(name)
        box = self.live(name)
        if box is None:
            return []
        box.kill_now()
        self.forget(box)
        return [name]

    def recover(self, name: str, into: Path) -> list[str]:
        """Nothing to save: the workspace is the host directory itself."""
        del into
        self.script_for(name).raise_if("recover", name)
        self.record("recover", name)
        return []

    def owned(self) -> list[str]:
        """The detached sandboxes this data dir launched that live on in this process
        (a fake sandbox dies with the process that made it)."""
        return self.detached_names()

    def cleanup_orphans(self) -> list[str]:
        """Nothing: a fake sandbox cannot outlive its owner."""
        return []
