"""The podman backend: hardened OCI containers under runc, crun or runsc (gVisor).

Every sandbox gets the seed's "Agent container" list (see
:func:`agentbox.backends.oci._args.run_args` for the flags and why each is
there). Two ways to run:

* :meth:`PodmanBackend.run`: one shot, the fastest path (``agentbox exec``, the
  launcher): ``podman run --rm`` with the command as the container's main
  process, stdio passed straight through (``--log-driver passthrough``).
* :meth:`PodmanBackend.create`: a sandbox that idles (``sleep infinity`` under
  tini) until commands are ``podman exec``'d into it.
* :meth:`PodmanBackend.launch` / ``follow``: detached, ``podman run -d`` with
  conmon alone holding it, followed from any process (live restore; see
  :mod:`agentbox.backends.podman._detach`).

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
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends._wsdisk import settle_orphan_disks, workspace_disk
from agentbox.backends.base import (
    LABEL,
    OWNER_DATA_LABEL,
    BackendKind,
    ExecResult,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.oci._args import (
    CONMON_GRACE,
    ImageFacts,
    check_spec,
    entry_argv,
    forget_image,
    image_facts,
    run_args,
)
from agentbox.backends.oci._cli import (
    Capture,
    conmon_cwd,
    env_file,
    force_remove,
    kill,
    owner_start,
    podman_error,
    stdin_fd,
)
from agentbox.backends.oci._posture import wait_relay
from agentbox.backends.oci._sandbox import start_on_disk
from agentbox.backends.podman import _pool, _pool_ends, _removals
from agentbox.backends.podman._detach import (
    DETACHED_LABEL,
    PodmanDetached,
    conmon_of,
    inspect,
    is_detached,
)
from agentbox.backends.podman._exitfile import wait_exited
from agentbox.backends.podman._pool_slots import pool_holds
from agentbox.backends.podman._sandbox import PodmanSandbox
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.core.oci import HOST_KERNEL_RUNTIMES, PODMAN_RUNTIMES
from agentbox.errors import AgentboxError, CommandError, CommandTimeout, ConfigError, SandboxError

log = get_logger(__name__)


class PodmanBackend(PodmanDetached):
    """Hardened podman containers; see the module docstring.

    ``unsafe_extra_args`` weakens every sandbox this backend makes; it is for
    the escape suite's positive controls only and is not reachable from a
    Boxfile or the normal CLI.
    """

    name = "podman"
    kind: BackendKind = "container"
    #: An SDK sandbox's first command can be a ``podman exec -i`` started ahead (the
    #: launcher's spare, ``launcher/_primed.py``).
    primes_exec = True
    #: A sandbox's init is the child of a ``conmon -n NAME`` (the resource sampler finds it
    #: in ``/proc`` that way, without a podman process or the container's lock).
    init_parent_process = "conmon"
    runtimes: tuple[str, ...] = PODMAN_RUNTIMES
    snapshots = False
    environments_refused: str | None = None  # the environment: a host overlay bind-mounted

    def shares_host_kernel(self, runtime: str) -> bool:
        """runc and crun run on the host's kernel; runsc (gVisor) brings its own."""
        return runtime in HOST_KERNEL_RUNTIMES

    def bind_source_uid(self, runtime: str) -> int | None:
        """runsc's gofer opens bind-mount sources as the mapped container root."""
        return self.settings.sandbox_subid_base if runtime == "runsc" else None

    def warm(self, image: str) -> None:
        """``podman image inspect`` ahead of the launch (a podman process: ~0.1 s a fresh
        ``agentbox run`` otherwise pays between its workspace copy and its sandbox)."""
        with contextlib.suppress(AgentboxError):
            image_facts(image)

    def __init__(self, settings: Settings, *, unsafe_extra_args: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.unsafe_extra_args = tuple(unsafe_extra_args)
        #: What a pool claim knows of the sandbox it just started (``follow`` takes it
        #: once instead of a first ``podman inspect``: the task's output comes sooner).
        self.claimed: dict[str, dict[str, Any]] = {}
        if self.unsafe_extra_args:
            log.warning("podman backend weakened on purpose", extra=self.unsafe_extra_args)

    def check(self, spec: SandboxSpec) -> None:
        """Refuse ``spec`` before anything starts: runtime, image, mounts, uid."""
        check_spec(spec, subid_base=self.settings.sandbox_subid_base)

    def _labels(self, spec: SandboxSpec) -> SandboxSpec:
        labels = {LABEL: "1", **spec.labels, "io.agentbox.owner-start": owner_start()}
        return spec.replace(labels=labels)

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """A pooled sandbox of ``spec``'s shape if one waits (see ``_pool``), else
        ``podman run -d`` (:meth:`PodmanDetached.launch`)."""
        if not _pool.claim(self, spec, argv, log_path=log):
            super().launch(spec, argv, log=log)

    def pool_refused(self, runtime: str) -> str | None:
        """None under runc/crun; gVisor's sandboxes do not receive mounts made at claim."""
        if runtime in ("runc", "crun"):
            return None
        return f"no warm pool under {runtime}: its sandboxes do not receive mounts at claim"

    def fill_pool(self, template: SandboxSpec, size: int, *, ttl: float) -> list[str]:
        """Start pooled sandboxes of ``template``'s shape until ``size`` wait (``_pool``)."""
        return _pool.fill(self, template, size, ttl=ttl)

    def drain_pool(self, *, everything: bool = True) -> list[str]:
        """Remove unclaimed pooled sandboxes (all, or only expired and dead ones)."""
        return _pool_ends.sweep(self.settings, everything=everything)

    def _settle(self, name: str, conmon: psutil.Process | None, *, ended: bool = False) -> None:
        _pool_ends.release(self.settings, name)  # a pooled sandbox's slot binds first
        super()._settle(name, conmon, ended=ended)

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
        facts = check_spec(spec, subid_base=self.settings.sandbox_subid_base)
        assert facts is not None
        spec = self._labels(spec)
        out, err = Capture(on_stdout), Capture(on_stderr)
        fired = threading.Event()

        def expire() -> None:
            fired.set()
            kill(spec.name)

        watchdog = threading.Timer(spec.deadline, expire)
        watchdog.daemon = True
        rc: int | None = None
        # The workspace disk outlives the container: copied back only once it is removed.
        with workspace_disk(self.settings, spec):
            started = time.monotonic()
            try:
                with (
                    env_file(spec.env) as envf,
                    stdin_fd(stdin) as fd,
                    self._conmon_dir(spec.name) as cwd,
                ):
                    args = run_args(
                        spec,
                        self.settings,
                        facts,
                        detach=False,
                        env_file=envf.path,
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
                            cwd=cwd,
                        )
                    except CommandTimeout:
                        fired.set()
            finally:
                watchdog.cancel()
                # --rm removes the container on a normal exit; after a kill, a timeout or an
                # error (ours or podman's) make sure nothing is left.
                if rc is None or fired.is_set() or rc >= 125:
                    force_remove(spec.name)
        timed_out = fired.is_set() or (
            rc in (137, 255) and time.monotonic() - started >= spec.deadline
        )
        if rc in (125, 126, 127) and podman_error(err.tail):
            self._raise_start_error(spec, err.tail)
        return ExecResult(rc if rc is not None else -1, out.data, err.data, timed_out=timed_out)

    @contextlib.contextmanager
    def _conmon_dir(self, name: str) -> Iterator[Path]:
        """A private working directory for a ``podman run --rm`` and its conmon.

        With ``--rm`` conmon has no persist dir and writes its ``oom`` marker (a
        process in the sandbox was OOM-killed) into its working directory: that must
        not be the caller's (a user's repo, a test's cwd). We log the marker, then
        remove the directory.
        """
        root = self.settings.data_dir / "run"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        d = Path(tempfile.mkdtemp(prefix="conmon-", dir=root))
        try:
            yield d
        finally:
            if (d / "oom").exists():
                log.warning("a process in the sandbox was OOM-killed", sandbox=name)
            shutil.rmtree(d, ignore_errors=True)

    def _raise_start_error(self, spec: SandboxSpec, tail: bytes) -> None:
        msg = tail.decode(errors="replace").strip()
        forget_image(spec.image)
        image_facts(spec.image, refresh=True)  # raises ImageError if it vanished
        raise SandboxError(f"podman could not start it: {msg}", sandbox=spec.name)

    def create(self, spec: SandboxSpec) -> PodmanSandbox:
        """Start a sandbox idling under tini; ``exec`` commands into it; ``destroy`` it."""
        facts = check_spec(spec, subid_base=self.settings.sandbox_subid_base)
        assert facts is not None
        spec = self._labels(spec)
        return start_on_disk(self.settings, spec, lambda s: self._create(s, facts), wait_relay)

    def _create(self, spec: SandboxSpec, facts: ImageFacts) -> PodmanSandbox:
        with env_file(spec.env) as envf:
            args = run_args(
                spec,
                self.settings,
                facts,
                detach=True,
                env_file=envf.path,
                unsafe_extra_args=self.unsafe_extra_args,
            )
            args += entry_argv(spec, ["sleep", "infinity"])
            try:
                res = _proc.run(args, timeout=120, cwd=conmon_cwd())
            except CommandError as exc:
                with contextlib.suppress(AgentboxError):
                    force_remove(spec.name)
                if "image not known" in exc.stderr:
                    forget_image(spec.image)
                    image_facts(spec.image, refresh=True)
                raise SandboxError(f"could not start: {exc}", sandbox=spec.name) from exc
        box = PodmanSandbox(self, spec, res.stdout.strip())
        box._start_watchdog()
        return box

    def interactive(self, spec: SandboxSpec, argv: Sequence[str]) -> int:
        """``podman run -it`` with the same hardening, on this terminal; returns the exit code.

        The one place that does not go through ``agentbox.core.proc``: the child
        must own the terminal.
        """
        facts = check_spec(spec, subid_base=self.settings.sandbox_subid_base)
        assert facts is not None
        spec = self._labels(spec)
        with (
            workspace_disk(self.settings, spec),
            env_file(spec.env) as envf,
            self._conmon_dir(spec.name) as cwd,
        ):
            args = run_args(
                spec,
                self.settings,
                facts,
                detach=False,
                env_file=envf.path,
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
                return subprocess.call(args, cwd=cwd)
            finally:
                force_remove(spec.name)

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

    def kill(self, name: str) -> list[str]:
        """Kill container ``name`` (SIGKILL first, so the workload stops at once) and
        remove it; absent is fine. The workspace is a host bind mount: nothing is lost.

        A detached sandbox is only killed: its follower (``follow``) then returns exit
        137, records the end, and removes it as after any other end. No container: nothing
        to remove (a ``podman rm`` now could remove one a launch is creating this moment)."""
        _removals.await_rename(name)  # a pool claim of this process names it
        kill(name)  # the module-level helper of _oci_cli
        info = inspect(name)
        if info is None:
            return []
        if is_detached(info):
            return [name]
        force_remove(name)
        return [name]

    def reap(self, name: str) -> list[str]:
        """Remove container ``name`` whose owner died, then settle its workspace disk:
        what the agent wrote is copied back into the workspace directory, where the
        owner would have collected it, and the disk unmounted (see _wsdisk.py).
        A detached sandbox's disk is settled once its conmon, its recorded owner, is gone."""
        info = inspect(name)  # after a pool claim's rename to it (see _removals)
        conmon = conmon_of(info) if info is not None else None
        kill(name)
        force_remove(name)
        done = [name]
        if conmon is not None:
            wait_exited(conmon, 15)  # exited, not reaped: a late-reaping init costs seconds
        _pool_ends.release(self.settings, name)
        for disk in settle_orphan_disks(self.settings, name):
            log.info("settled the workspace disk of a dead owner", sandbox=disk)
        return done

    def recover(self, name: str, into: Path) -> list[str]:
        """The workspace is a host bind mount: only a workspace disk needs settling (what
        the agent wrote copied back into the workspace it was made from, ``into``)."""
        del into  # a container's files are already where its owner collects them
        return list(settle_orphan_disks(self.settings, name))

    def owned(self) -> list[str]:
        """Containers labelled with this data dir (the launcher labels every task's).

        Not what the warm pool answers for (:func:`_pool_slots.pool_holds`): its
        unclaimed entries, which its own sweep (:meth:`drain_pool`) removes once their
        keeper is gone, and a fill or claim under way (a claimed container has the
        slot's name until the claim's rename)."""
        argv = ["podman", "ps", "-a", "--filter", f"label={LABEL}=1",
                "--filter", f"label={OWNER_DATA_LABEL}={data_dir_label(self.settings.data_dir)}",
                "--format", "{{.Names}}"]  # fmt: skip
        try:
            res = _proc.run(argv, timeout=60, check=False)
        except AgentboxError:
            return []
        return [n for n in res.stdout.split() if not pool_holds(self.settings, n)]

    def cleanup_orphans(self) -> list[str]:
        """Remove labelled containers whose owner process is gone, except detached ones;
        return their names.
        """
        removed = []
        removed_disks = []
        for c in self.list_sandboxes():
            labels = c.get("Labels") or {}
            names = c.get("Names") or []
            if not isinstance(labels, dict) or not isinstance(names, list) or not names:
                continue
            if _owner_alive(labels) or labels.get(DETACHED_LABEL) == "1":
                # A detached sandbox outlives its launcher on purpose: its data dir's
                # next launcher adopts it (follow) or reaps it (owned() lists it).
                continue
            name = str(names[0])
            log.info("removing orphan sandbox", sandbox=name)
            force_remove(name)
            removed.append(name)
        # Only once their containers are gone: workspace disks whose owner died.
        for name in settle_orphan_disks(self.settings):
            log.info("settled the workspace disk of a dead owner", sandbox=name)
            removed_disks.append(name)
        return removed + [n for n in removed_disks if n not in removed]


def _owner_alive(labels: Mapping[str, object]) -> bool:
    try:
        pid = int(str(labels.get("io.agentbox.owner-pid", "")))
        start = str(labels.get("io.agentbox.owner-start", ""))
        proc = psutil.Process(pid)
        return f"{proc.create_time():.0f}" == start
    except (ValueError, psutil.Error):
        return False
