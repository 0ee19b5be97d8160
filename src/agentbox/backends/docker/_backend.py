"""The docker backend: the seed's own engine, hardened like podman, through the Engine API."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends._attached import NoPool
from agentbox.backends._wsdisk import settle_orphan_disks
from agentbox.backends.base import (
    LABEL,
    OWNER_DATA_LABEL,
    BackendKind,
    BindMount,
    ExecResult,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.docker._binds import HostBinds, sweep
from agentbox.backends.docker._client import GuardedClient, connect
from agentbox.backends.docker._config import (
    DaemonFacts,
    container_body,
    daemon_facts,
    docker_runtime,
)
from agentbox.backends.docker._detach import DockerDetached, is_detached
from agentbox.backends.docker._image import ensure_image, forget_images
from agentbox.backends.docker._sandbox import DockerSandbox, status_of
from agentbox.backends.oci._cli import Capture, check_env, owner_start
from agentbox.backends.oci._sandbox import start_on_disk, wait_relay_inside
from agentbox.backends.oci._userns_limits import HOOK_SCRIPT, SANDBOX_CAPS
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ConfigError, PathRefused, SandboxError, UnsupportedError

log = get_logger(__name__)

DEFAULT_HOST = "unix:///var/run/docker.sock"
RUNTIMES = ("runc", "runsc")


def _check_dir(path: Path, what: str) -> None:
    if not path.is_absolute() or not path.is_dir():
        raise PathRefused(f"{what} is not an existing absolute directory", path=path)


class DockerBackend(DockerDetached, NoPool):
    """Hardened Docker containers under runc or runsc (gVisor); docs/reference/docker-backend.md.

    Used by the launcher only (it holds ``docker.sock``, which is root-equivalent);
    every Engine call goes through the allow-list of :mod:`._client`.
    ``unsafe_host_config`` weakens every sandbox it makes: for the escape suite's
    positive controls only, unreachable from a Boxfile or the normal CLI.
    """

    name = "docker"
    kind: BackendKind = "container"
    runtimes: tuple[str, ...] = RUNTIMES
    snapshots = False
    environments_refused: str | None = None  # as podman: a host overlay bind-mounted

    def __init__(
        self,
        settings: Settings,
        *,
        base_url: str | None = None,
        unsafe_host_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.base_url = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_HOST
        self.unsafe_host_config = dict(unsafe_host_config or {})
        if self.unsafe_host_config:
            log.warning("docker backend weakened on purpose", extra=self.unsafe_host_config)
        self._client: GuardedClient | None = None
        self._facts: DaemonFacts | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> GuardedClient:
        with self._lock:
            if self._client is None:
                self._client = connect(self.base_url)
            return self._client

    def facts(self) -> DaemonFacts:
        """The daemon's version, runtimes, AppArmor and userns-remap (read once)."""
        with self._lock:
            if self._facts is not None:
                return self._facts
        try:
            info = self.client.api.info()
            version = self.client.api.version(api_version=False)
        except Exception as exc:
            raise UnsupportedError(
                f"no docker daemon at {self.base_url}: {exc}",
                fix="scripts/setup.sh starts one (dockerd --iptables=false --bridge=none)",
            ) from exc
        facts = daemon_facts(info, version)
        with self._lock:
            self._facts = facts
        return facts

    def shares_host_kernel(self, runtime: str) -> bool:
        """runc runs on the host's kernel; runsc (gVisor) brings its own."""
        return runtime == "runc"

    def bind_source_uid(self, runtime: str) -> int | None:
        """Who opens the bind-mount sources: under runsc, gVisor's gofer, as the daemon's
        remapped root (host uid ``remap_base``), which the launcher's private data dir must
        let search (an ACL entry); under runc, dockerd's own root (None: nothing to grant)."""
        if runtime != "runsc":
            return None
        return self.facts().remap_base

    def warm(self, image: str) -> None:
        """Nothing ahead: a docker sandbox runs attached, and its image id is looked up (and
        imported if missing) at its create, through the daemon."""
        del image

    def check(self, spec: SandboxSpec) -> None:
        """Refuse ``spec`` before anything starts: runtime, uid mapping, mounts, env."""
        if spec.runtime not in RUNTIMES:
            raise UnsupportedError(f"runtime {spec.runtime!r} is not offered by the docker backend",
                                   fix=f"use one of {', '.join(RUNTIMES)}")  # fmt: skip
        facts = self.facts()
        want = docker_runtime(spec)
        if want not in facts.runtimes:
            raise UnsupportedError(
                f"the docker daemon has no runtime {want!r} (it has {', '.join(facts.runtimes)})",
                fix="register runsc and runsc-gw in /etc/docker/daemon.json (scripts/setup.sh; "
                "see docs/reference/docker-backend.md)",
            )
        if facts.remap_base is not None and facts.remap_base < 0:
            raise UnsupportedError(f"cannot read the userns-remap base from {facts.root_dir}")
        if not 0 < spec.uid < 65536:
            raise UnsupportedError(f"sandbox uid {spec.uid} is outside the 65536-id map")
        if facts.host_uid(spec.uid) != self.settings.sandbox_host_uid:
            raise UnsupportedError(
                f"docker maps sandbox uid {spec.uid} to host uid {facts.host_uid(spec.uid)} "
                f"({facts.userns_mode}), but agentbox gives workspaces to host uid "
                f"{self.settings.sandbox_host_uid}",
                fix=f"set userns-remap with subordinate ids from {self.settings.subid_base} "
                "(scripts/setup.sh), or AGENTBOX_SUBID_BASE to the remap base in force",
            )
        if spec.workspace is not None:
            _check_dir(spec.workspace, "workspace")
        if spec.gateway_dir is not None:
            _check_dir(spec.gateway_dir, "gateway dir")
        for m in spec.mounts:
            if not m.source.is_absolute() or not m.source.exists():
                raise PathRefused("declared mount is not an existing absolute path", path=m.source)
        check_env(spec.env)

    def _labels(self, spec: SandboxSpec) -> SandboxSpec:
        labels = {LABEL: "1", **spec.labels, "io.agentbox.owner-start": owner_start()}
        return spec.replace(labels=labels)

    def create(self, spec: SandboxSpec) -> DockerSandbox:
        """Start a sandbox idling under tini; ``exec`` commands into it; ``destroy`` it."""
        self.check(spec)
        image_id = ensure_image(self.client, self.settings, spec.image)
        spec = self._labels(spec)
        return start_on_disk(
            self.settings, spec, lambda s: self._start(s, image_id), wait_relay_inside
        )

    def _bound(self, spec: SandboxSpec, binds: HostBinds) -> SandboxSpec:
        """``spec`` with every source replaced by its hardened bind point (see _binds.py)."""
        ws = spec.workspace and binds.add(spec.workspace, read_only=False)
        gw = spec.gateway_dir and binds.add(spec.gateway_dir, read_only=False, noexec=True)
        mounts = tuple(
            BindMount(binds.add(m.source, read_only=m.read_only), m.target, m.read_only)
            for m in spec.mounts
        )
        return spec.replace(workspace=ws, gateway_dir=gw, mounts=mounts)

    def _start(self, spec: SandboxSpec, image_id: str) -> DockerSandbox:
        binds = HostBinds(self.settings, spec.name)
        gofer = self.bind_source_uid(spec.runtime)
        try:
            if gofer is not None:
                # gVisor's gofer opens the hardened bind points under the private data dir:
                # let that one uid search the dirs above them, as the launcher does for a
                # task's own (exec and the escape suite have no launcher to do it).
                binds.let_through(gofer)
            body = container_body(self._bound(spec, binds), self.settings, self.facts(),
                                  image_id, unsafe_host_config=self.unsafe_host_config)  # fmt: skip
            made = self.client.api.create_container_from_config(body, name=spec.name)
        except BaseException as exc:
            binds.release()
            if not isinstance(exc, Exception) or isinstance(exc, AgentboxError):
                raise
            if status_of(exc) == 404:
                forget_images()
            raise SandboxError(f"docker could not create it: {exc}", sandbox=spec.name) from exc
        box = DockerSandbox(self, spec, str(made.get("Id") or spec.name))
        box._binds = binds
        api = self.client.api
        try:
            api.start(box.id)
        except Exception as exc:
            with contextlib.suppress(AgentboxError):
                box._remove()  # the container, then its bind points (kill no longer does)
            raise SandboxError(f"docker could not start it: {exc}", sandbox=spec.name) from exc
        box._start_watchdog()
        if spec.runtime == "runc":
            try:
                self._cap_userns(box)
            except BaseException:
                box.destroy()
                raise
        return box

    def _cap_userns(self, box: DockerSandbox) -> None:
        """Cap the per-user kernel counters of the sandbox's user namespace (inotify,
        fanotify, namespaces: see _userns_limits.py) before anything of the agent runs.

        podman runs this as an OCI prestart hook; the Engine runs no hooks, so we run
        the same script from the host against the started container's init, and fail
        closed. Only the sandbox's own sleep (or our relay) has run by then.
        """
        pid = box.inspect().get("State", {}).get("Pid")
        if not isinstance(pid, int) or pid <= 1:
            raise SandboxError("no init pid to cap its user namespace", sandbox=box.name)
        self._cap_pid(pid, box.name)

    def _cap_pid(self, pid: int, name: str) -> None:
        """Cap the user namespace of the sandbox whose init is host ``pid`` (see above)."""
        args = [f"{k}={v}" for k, v in sorted(SANDBOX_CAPS.items())]
        try:
            _proc.run(["/bin/sh", "-c", HOOK_SCRIPT, "hook", *args],
                      input=json.dumps({"pid": pid}), timeout=30)  # fmt: skip
        except AgentboxError as exc:
            # The hook's own words (its last stderr line), not the script's text.
            said = getattr(exc, "stderr", "").strip().splitlines()
            why = said[-1][:300] if said else str(exc).splitlines()[0][:300]
            raise SandboxError(f"cannot cap its user namespace: {why}", sandbox=name) from exc

    def run(
        self,
        spec: SandboxSpec,
        argv: Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """One shot: a fresh sandbox runs ``argv``, then is destroyed (whatever happens).

        The sandbox's deadline kills it (``timed_out`` set), and its own clock ends it
        a little later should this process have died.
        """
        if not argv:
            raise ConfigError("run needs a command")
        out, err = Capture(on_stdout), Capture(on_stderr)
        with self.create(spec) as box:
            res = box.exec(argv, stdin=stdin, on_stdout=out, on_stderr=err)
            expired = box.expired
        return ExecResult(res.exit_code, out.data, err.data, timed_out=res.timed_out or expired)

    # Verbs by name: from any process, without a handle.

    def kill_container(self, ident: str) -> None:
        """SIGKILL container ``ident`` (absent or stopped is fine)."""
        try:
            self.client.api.kill(ident, signal="SIGKILL")
        except Exception as exc:
            if status_of(exc) not in (404, 409):
                raise SandboxError(f"docker kill: {exc}", sandbox=ident) from exc

    def remove_container(self, ident: str) -> bool:
        """Kill and remove container ``ident``, then wait until it is gone; absent is fine
        (False: there was no container to remove)."""
        api = self.client.api
        self.kill_container(ident)
        err: Exception | None = None
        for _ in range(5):
            try:
                api.remove_container(ident, force=True)
                return True
            except Exception as exc:
                if status_of(exc) == 404:
                    return err is not None  # gone since a failed try: it was there
                err = exc
                with contextlib.suppress(Exception):
                    api.wait(ident, timeout=2, condition="removed")
        raise SandboxError(f"could not remove: {err}", sandbox=ident) from err

    def kill(self, name: str) -> list[str]:
        """Kill container ``name`` and remove it, then its bind points; absent is fine.
        The workspace is a host bind mount: nothing is lost.

        No container: nothing is released. Its bind points may be the ones a launch is
        preparing this moment, before it creates the container (a cancel, repeated by
        the launcher's monitor, can come then); the owner releases them when its
        sandbox ends or fails to start, :meth:`reap` when the owner is dead.

        A detached sandbox is only killed: its follower reads the rest of its output,
        records the end and removes it (and :meth:`reap` does when none follows)."""
        try:
            info = self.client.api.inspect_container(name)
        except Exception:
            info = None
        labels = (info or {}).get("Config", {}).get("Labels") if isinstance(info, dict) else None
        if isinstance(labels, dict) and is_detached(labels):
            self.kill_container(name)
            return [name]
        if not self.remove_container(name):
            return []
        HostBinds(self.settings, name).release_all()
        return [name]

    def reap(self, name: str) -> list[str]:
        """Remove container ``name`` whose owner died and its bind points (container or
        not: no launch of a dead owner is in progress), then settle its workspace disk."""
        self.remove_container(name)
        HostBinds(self.settings, name).release_all()  # before the disk they may bind
        for disk in settle_orphan_disks(self.settings, name):
            log.info("settled the workspace disk of a dead owner", sandbox=disk)
        return [name]

    def recover(self, name: str, into: Path) -> list[str]:
        """The workspace is a host bind mount: only a workspace disk needs settling."""
        del into
        return list(settle_orphan_disks(self.settings, name))

    def list_sandboxes(self, *labels: str) -> list[dict[str, Any]]:
        """Every container labelled as an agentbox sandbox (and ``labels``), running or not."""
        try:
            return self.client.containers([f"{LABEL}=1", *labels])
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"docker ps at {self.base_url}: {exc}") from exc

    def owned(self) -> list[str]:
        """Containers labelled with this data dir (the launcher labels every task's)."""
        try:
            found = self.list_sandboxes(
                f"{OWNER_DATA_LABEL}={data_dir_label(self.settings.data_dir)}"
            )
        except (AgentboxError, UnsupportedError):
            return []
        return [n for c in found for n in _names(c)[:1]]

    def cleanup_orphans(self) -> list[str]:
        """Remove labelled containers whose owner process is gone; return their names."""
        removed = []
        for c in self.list_sandboxes():
            names = _names(c)
            labels = c.get("Labels") or {}
            if not names or not isinstance(labels, dict) or _owner_alive(labels):
                continue
            if is_detached(labels):
                # A detached sandbox outlives its launcher on purpose: its data dir's
                # next launcher adopts it (follow) or reaps it (owned() lists it).
                continue
            log.info("removing orphan sandbox", sandbox=names[0])
            self.remove_container(names[0])
            removed.append(names[0])
        sweep(self.settings, keep={n for c in self.list_sandboxes() for n in _names(c)})
        for name in settle_orphan_disks(self.settings):
            log.info("settled the workspace disk of a dead owner", sandbox=name)
            if name not in removed:
                removed.append(name)
        return removed


def _names(c: Mapping[str, object]) -> list[str]:
    names = c.get("Names") or []
    return [str(n).lstrip("/") for n in names] if isinstance(names, list) else []


def _owner_alive(labels: Mapping[str, object]) -> bool:
    try:
        pid = int(str(labels.get("io.agentbox.owner-pid", "")))
        start = str(labels.get("io.agentbox.owner-start", ""))
        return f"{psutil.Process(pid).create_time():.0f}" == start
    except (ValueError, psutil.Error):
        return False
