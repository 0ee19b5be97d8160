"""The sandbox backend Protocol: one small interface, several backends.

Every backend (podman, qemu, firecracker, and the in-process
:class:`~agentbox.backends.fake.FakeBackend`) implements :class:`Backend` and the
:class:`Sandbox` it creates, and passes the same contract tests
(``tests/integration/test_backend_contract.py``). A backend refuses a spec it
cannot honour *before* anything starts (:meth:`Backend.check`).

The Protocol is the *whole* contract: no caller outside ``agentbox.backends``
compares a backend's name. What a caller needs to know of a backend's kind is
one of its traits (:attr:`Backend.kind`, :attr:`Backend.runtimes`); what it
needs done is one of its verbs:

=====================  ===========================================================
``check/create/run``   refuse early; start a sandbox; one-shot command
``kill(name)``         stop a sandbox by name from any process (cancel, deadline)
``reap(name)``         owner died: kill, save what it wrote, remove
``recover(name, into)`` save what a dead sandbox wrote into a directory
``owned()``            the sandboxes this data dir owns (a restarted launcher)
``cleanup_orphans()``  remove sandboxes no live owner holds
``bind_source_uid``    which host uid opens the bind-mount sources (runsc's gofer)
``Sandbox.host_pids``  the host processes a sandbox breakout would become
``Sandbox.posture``    the live posture, read by the backend's own package
``detaches(runtime)``  whether the detached verbs below work for ``runtime``
``launch``             start a sandbox with nothing of ours attached (survives us)
``follow(name)``       stream its output from the start, wait, save, remove
``adoptable(name)``    whether a sandbox is ours to follow (labels, data dir)
``fill/drain_pool``    a warm pool ``launch`` claims from (``pool_refused``: why none)
=====================  ===========================================================

Detached sandboxes (live restore): ``launch`` starts one with nothing of ours
attached, its deadline held without us, its output in a log the caller names;
any process (a launcher started after the first died) follows it (``follow``) from the
log's start to its end. Where ``detaches`` is False the three raise
:class:`~agentbox.errors.UnsupportedError`; callers use ``run``.

Names live in one place, the registry in :mod:`agentbox.backends`
(:data:`~agentbox.backends.BACKENDS`). :class:`BaseSandbox` is the small concrete
base a backend's sandbox may build on: it owns the context manager and an
idempotent, *verified* :meth:`~BaseSandbox.destroy`.

Layout inside every sandbox, whatever the backend:

* ``/workspace``           the workspace, read-write (qemu: the ``/data`` disk)
* ``/run/agentbox/gw``     the gateway socket's directory (podman); qemu relays it over its channel
* ``/opt/agentbox``        our in-sandbox programs (relay shim, guest agent, probes), read-only
* ``/tmp``, ``$HOME``      tmpfs (``HOME=/home/agent``)
* declared mounts          read-only, at their targets

The model gateway: when ``SandboxSpec.gateway_dir`` is set, the *backend* makes
``http://127.0.0.1:GATEWAY_PORT`` inside the sandbox reach the unix socket
``gateway_dir/gateway.sock`` on the host (podman: our relay shim in the container,
started before the command; qemu: the guest agent multiplexes each connection
over its channel). Callers set ``ANTHROPIC_BASE_URL`` to that address and know
nothing else of the path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol, Self, runtime_checkable

from agentbox.backends._sandbox_base import BaseSandbox
from agentbox.boxfile import Resources
from agentbox.core.execution import ExecResult, OutputCallback
from agentbox.errors import UnsupportedError

__all__ = [
    "GATEWAY_DIR_IN_SANDBOX",
    "GATEWAY_PORT",
    "GATEWAY_SOCKET_NAME",
    "HOME_IN_SANDBOX",
    "LABEL",
    "MAX_LOG_BYTES",
    "OWNER_DATA_LABEL",
    "WORKSPACE_IN_SANDBOX",
    "Backend",
    "BackendKind",
    "BaseSandbox",
    "BindMount",
    "ExecResult",
    "Exited",
    "OutputCallback",
    "Posture",
    "PostureCheck",
    "Sandbox",
    "SandboxSpec",
    "data_dir_label",
    "refuse_detached",
]

WORKSPACE_IN_SANDBOX = "/workspace"
GATEWAY_DIR_IN_SANDBOX = "/run/agentbox/gw"
HOME_IN_SANDBOX = "/home/agent"
#: Loopback port inside every sandbox that reaches the task's gateway.
GATEWAY_PORT = 8080
#: Name of the gateway's socket inside ``SandboxSpec.gateway_dir``.
GATEWAY_SOCKET_NAME = "gateway.sock"
#: Label put on every sandbox (container, VM jail) so orphans can be found and removed.
LABEL = "io.agentbox.sandbox"
#: Label naming the data dir whose launcher owns a sandbox (value: :func:`data_dir_label`).
OWNER_DATA_LABEL = "io.agentbox.data"

#: What kind of isolation a backend gives: a container shares the host's kernel
#: (unless its runtime brings its own, gVisor), a microVM always runs its own.
BackendKind = Literal["container", "microvm", "process"]


def data_dir_label(data_dir: Path) -> str:
    """A label value naming ``data_dir``: launchers of other data dirs leave its sandboxes be."""
    return hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]


def refuse_detached(backend: str, runtime: str | None = None) -> UnsupportedError:
    """The error a backend whose ``detaches()`` is False raises from launch/follow/adoptable."""
    what = f"{backend} ({runtime})" if runtime else backend
    return UnsupportedError(
        f"the {what} backend cannot run a sandbox detached",
        fix="use run(): the sandbox then lives as long as its caller",
    )


#: The cap on a detached sandbox's output log (stdout and stderr together, per file).
#: What a backend does at the cap is in its ``launch`` docstring (podman: keeps the last part).
MAX_LOG_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class BindMount:
    """A host path made visible in the sandbox (declared mounts are read-only)."""

    source: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to create one sandbox; built from a Boxfile and Settings.

    Paths in it have already been validated (mount roots, data dir) by the caller.
    """

    name: str
    image: str
    runtime: Literal["runc", "crun", "runsc"] = "runc"
    isolation: Literal["standard", "strict"] = "standard"
    resources: Resources = field(default_factory=Resources)
    mounts: tuple[BindMount, ...] = ()
    workspace: Path | None = None
    gateway_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    deadline: float = 3600.0
    """Seconds; the backend enforces it itself (a watchdog outside the caller's event loop)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    uid: int = 64000
    workdir: str = WORKSPACE_IN_SANDBOX

    def replace(self, **changes: object) -> SandboxSpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Exited:
    """How a detached sandbox ended (:meth:`Backend.follow`)."""

    exit_code: int
    """The main command's exit code; -1 if unknown."""
    timed_out: bool
    """Killed at ``spec.deadline`` (by the runtime's own timeout, or a kill after it)."""


@dataclass(frozen=True)
class PostureCheck:
    """One fact about a live sandbox, read from inside it or from the host."""

    name: str
    expected: str
    seen: str
    ok: bool
    where: Literal["inside", "host"] = "inside"


@dataclass(frozen=True)
class Posture:
    """What a live sandbox looks like; ``ok`` only when every check passed."""

    backend: str
    runtime: str
    checks: tuple[PostureCheck, ...]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "runtime": self.runtime,
            "ok": self.ok,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }


@runtime_checkable
class Sandbox(Protocol):
    """A live sandbox. ``destroy`` is idempotent and leaves nothing behind."""

    name: str

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
        """Run ``argv`` as the sandbox uid; stream output to the callbacks if given."""
        ...

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy a host file or directory into the sandbox at ``dest``."""
        ...

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy ``src`` out of the sandbox to ``dest`` through the safe path layer."""
        ...

    def posture(self) -> Posture:
        """Read the live posture (inside and from the host), by the backend's own package."""
        ...

    def host_pids(self) -> list[int]:
        """Host pids of the sandbox's processes: what a process that broke out would be
        (a container's init and the rest of its cgroup; a microVM's VMM). Raises
        :class:`~agentbox.errors.SandboxError` when it is not running."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workload (TERM, then KILL after ``timeout``); keeps its files."""
        ...

    def destroy(self) -> None:
        """Remove the sandbox and everything it held on the host; idempotent."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Makes sandboxes of one kind."""

    name: str
    #: container, microvm or process (the fake): callers ask this, never the name.
    kind: BackendKind
    #: The OCI runtimes ``SandboxSpec.runtime`` may name (empty: the field is ignored).
    runtimes: tuple[str, ...]
    #: Whether it restores sandboxes from a snapshot (built with ``cold=True``, it boots fresh).
    snapshots: bool
    #: None if its sandboxes take an environment (``[setup]``'s phase with its
    #: egress socket, a frozen environment mounted copy-on-write, ``[network] allow``);
    #: else why not, which the refusal at submit quotes (``env.check_env_policy``).
    environments_refused: str | None

    def shares_host_kernel(self, runtime: str) -> bool:
        """Whether a sandbox of this backend with ``runtime`` runs on the host's kernel."""
        ...

    def bind_source_uid(self, runtime: str) -> int | None:
        """The host uid that opens bind-mount sources under ``runtime``, when it is not
        root (gVisor's gofer under podman: the mapped root, ``subid_base``): the caller
        must let that uid search the private dirs above the workspace. None: root does."""
        ...

    def warm(self, image: str) -> None:
        """Look up now what a launch of ``image`` will need and this process keeps (podman:
        the image's id and entrypoint), so the launch does not wait for it: the launcher
        calls it on a thread while it prepares the workspace. Never raises (the launch
        itself says what is wrong); a backend with nothing to look up does nothing."""
        ...

    def check(self, spec: SandboxSpec) -> None:
        """Raise (UnsupportedError, PolicyRefused, ImageError) if ``spec`` cannot be honoured."""
        ...

    def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox that idles until commands are exec'd in it."""
        ...

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """One-shot: a fresh sandbox runs ``argv`` as its main command, then is destroyed.

        The spec's deadline kills it (``timed_out`` set); nothing is left behind.
        """
        ...

    def kill(self, name: str) -> list[str]:
        """Kill sandbox ``name`` now, from any process, without a handle on it; idempotent.

        For a cancel or a deadline: the owner's ``run``/``exec`` returns (exit 137)
        and still collects what the sandbox wrote. Returns what was acted on.
        """
        ...

    def reap(self, name: str) -> list[str]:
        """Remove sandbox ``name`` whose owner died; idempotent.

        Kills it, saves what it wrote where its owner would have collected it
        (a microVM's ``/data`` disk into its recorded workspace), and removes
        the rest. Called by the owner's watchdog the moment the owner dies, and
        by a restarted launcher. Returns what was acted on.
        """
        ...

    def recover(self, name: str, into: Path) -> list[str]:
        """Save what dead sandbox ``name`` wrote into directory ``into``; idempotent.

        A microVM's ``/data`` disk is read (in userspace, in a jail) and its entries
        replace ``into``'s; a container whose workspace is a host bind mount has
        nothing to save beyond settling its workspace disk. The sandbox must be
        dead (killed, or its owner gone). Returns what was saved.
        """
        ...

    def owned(self) -> list[str]:
        """Names of this backend's sandboxes that this data dir (``settings.data_dir``)
        owns, live or not: what a restarted launcher checks against its records."""
        ...

    def cleanup_orphans(self) -> list[str]:
        """Remove sandboxes of this backend that no live owner holds; return their names."""
        ...

    def detaches(self, runtime: str) -> bool:
        """Whether :meth:`launch`, :meth:`follow` and :meth:`adoptable` work for ``runtime``."""
        ...

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """Start a fresh sandbox running ``argv`` as its main command, detached; return
        once it runs.

        No process of ours stays attached, and ``spec.deadline`` is enforced without
        us. The sandbox's stdout and stderr are written by the runtime to ``log`` (a
        path the caller chose; the backend owns its format), capped near
        :data:`MAX_LOG_BYTES`. Raises what :meth:`run` raises when it cannot start.
        """
        ...

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Stream sandbox ``name``'s output from the start of ``log`` until it has exited
        and its output is drained; then save what it wrote (as :meth:`run` does) and
        remove it and everything of it.

        Called again (from another process, after a first follower died), it streams
        the whole output again, in order. Raises
        :class:`~agentbox.errors.SandboxGone` when no such sandbox exists.
        """
        ...

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Whether sandbox ``name`` exists (running or exited) under this backend and
        data dir and carries exactly ``labels`` (value-equal); anything else is refused."""
        ...

    def pool_refused(self, runtime: str) -> str | None:
        """None if this backend keeps a warm pool of ``runtime`` sandboxes that
        :meth:`launch` claims from; else why not (the launcher logs it, keeps none)."""
        ...

    def fill_pool(self, template: SandboxSpec, size: int, *, ttl: float) -> list[str]:
        """Start pooled sandboxes of ``template``'s shape until ``size`` wait; the names."""
        ...

    def drain_pool(self, *, everything: bool = True) -> list[str]:
        """Remove unclaimed pooled sandboxes (all; else only expired or dead ones)."""
        ...
