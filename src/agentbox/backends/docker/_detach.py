"""Detached docker sandboxes: nothing of ours attached, re-adoptable by a new launcher.

:meth:`~DockerDetached.launch` creates and starts a container whose main command is
the agent's (``detach``: the Engine holds it, no client stays attached), with the
same hardening as :meth:`~agentbox.backends.docker.DockerBackend.create`
(:func:`~agentbox.backends.docker._config.container_body`), never auto-removed, and
labelled and sealed as podman's are (:data:`DETACHED_LABEL`, :data:`DEADLINE_LABEL`,
:data:`SEAL_LABEL`: an HMAC of the name and data dir under ``<data_dir>/detach.key``).
dockerd, its containerd and the container's shim hold it: a launcher that dies (a
crash, a ``systemctl restart``, an upgrade) takes nothing of it along.

Its deadline holds without a launcher: the main command runs under coreutils
``timeout -s KILL`` for the deadline plus
:data:`~agentbox.backends.docker._config.DEADLINE_GRACE`, a child of the image's tini
(PID 1): when ``timeout`` ends (its deadline, or killed by the agent, who shares its
uid), tini exits and the container's pid namespace dies with every process in it.
The task's gateway stops by itself at its ``--exit-at`` too, and every follower
kills the container once the deadline has passed.

runc: the per-user kernel counters of the sandbox's user namespace are capped from
the host after the start (the Engine runs no OCI hook), before anything of the agent
runs: the command waits behind a gate (``/tmp/.agentbox-go``, touched by an exec once
the caps are in) exactly as an attached sandbox's first exec waits for them.

Output: the daemon's ``json-file`` log, capped at
:data:`~agentbox.backends.base.MAX_LOG_BYTES` (one file: at the cap the daemon starts
it over), read over ``GET /containers/{id}/logs`` from the start by each follower,
which writes it to the caller's log (under the task dir, conmon's ``k8s-file``
format, :mod:`agentbox.backends._k8slog`, started over at the same cap). The follower
records the end beside it (``<log>.exit``) before it removes the container, so a
follower that comes after replays that log and returns the same end.

``docker exec`` and ``shell`` stay attached by design: an interactive command lives
as long as its client.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.backends._detached import check_launch, detach_key
from agentbox.backends._k8slog import LogReader, exit_marker, format_output, read_exit, write_exit
from agentbox.backends._wsdisk import WorkspaceDisk, settle_orphan_disks
from agentbox.backends.base import (
    LABEL,
    MAX_LOG_BYTES,
    OWNER_DATA_LABEL,
    Exited,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.docker._binds import HostBinds
from agentbox.backends.docker._config import DEADLINE_GRACE, container_body
from agentbox.backends.docker._exec import exec_stream
from agentbox.backends.docker._image import ensure_image
from agentbox.backends.docker._sandbox import status_of
from agentbox.backends.oci._args import entry_argv
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError, SandboxGone

if TYPE_CHECKING:
    from agentbox.backends.docker._backend import DockerBackend

log = get_logger(__name__)

#: Set ("1") on a detached sandbox: orphan sweeps leave it to its data dir's launcher.
DETACHED_LABEL = "io.agentbox.detached"
#: The spec's deadline in seconds (the follower kills at StartedAt + this).
DEADLINE_LABEL = "io.agentbox.deadline"
#: HMAC of the name and data dir under the data dir's key: made by us, for this data dir.
SEAL_LABEL = "io.agentbox.seal"
#: The file whose existence lets a runc sandbox's command start (its caps are in).
GO_FILE = "/tmp/.agentbox-go"
#: ``sh -c GATE gate ARGV…``: wait for :data:`GO_FILE`, then become ``ARGV``.
GATE = f'while [ ! -e {GO_FILE} ]; do sleep 0.02; done; exec "$@"'
#: How long a follower waits for the log stream to drain once the container has exited.
_DRAIN = 30.0
#: How long one ``POST /containers/{id}/wait`` may block before the follower looks again.
_WAIT_SLICE = 30.0


def detached_argv(spec: SandboxSpec, argv: Sequence[str]) -> list[str]:
    """The container's command (after tini): ``argv`` behind the gateway relay, the caps
    gate (runc) and ``timeout -s KILL`` for the deadline plus the grace."""
    life = str(math.ceil(spec.deadline) + DEADLINE_GRACE)
    inner = entry_argv(spec, argv)
    if spec.runtime == "runc":
        inner = ["/bin/sh", "-c", GATE, "gate", *inner]
    return ["timeout", "-s", "KILL", life, *inner]


def seal(settings: Settings, name: str) -> str:
    """HMAC-SHA256 of ``name`` and the data dir under ``data_dir/detach.key`` (podman's
    seal): a container labelled by hand, or by another data dir, lacks it."""
    msg = f"{name}\0{data_dir_label(settings.data_dir)}".encode()
    return hmac.new(detach_key(settings), msg, hashlib.sha256).hexdigest()[:32]


def is_detached(labels: Mapping[str, object]) -> bool:
    """Whether a container's labels say ``launch`` made it."""
    return labels.get(DETACHED_LABEL) == "1"


class DockerDetached:
    """Mixed into :class:`~agentbox.backends.docker.DockerBackend`: the detached verbs."""

    settings: Settings

    def detaches(self, runtime: str) -> bool:
        """True for runc and runsc: the Engine holds the container, not its client."""
        return runtime in ("runc", "runsc")

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """Create and start the sandbox detached; return once it runs (see the module
        docstring). A name in use is refused (``SandboxError``), nothing of it touched."""
        be = self._be()
        check_launch(argv, log)
        be.check(spec)
        image_id = ensure_image(be.client, self.settings, spec.image)
        spec = be._labels(spec)
        spec = spec.replace(
            labels={
                **spec.labels,
                OWNER_DATA_LABEL: data_dir_label(self.settings.data_dir),
                DETACHED_LABEL: "1",
                DEADLINE_LABEL: f"{spec.deadline:g}",
                SEAL_LABEL: seal(self.settings, spec.name),
            }
        )
        stale = [p for p in (log, exit_marker(log), log.with_name(log.name + ".tmp")) if p.exists()]
        if _inspect(be, spec.name) is not None:
            # Never touch another sandbox's log, disk or container (a task launched twice).
            raise SandboxError("a sandbox of that name exists already", sandbox=spec.name)
        for path in stale:
            path.unlink(missing_ok=True)
        disk = None
        if spec.workspace is not None:
            limit = spec.resources.disk_limit(self.settings)
            disk = WorkspaceDisk(self.settings, spec.name, spec.workspace, limit, detached=True)
        binds = HostBinds(self.settings, spec.name)
        made = False  # from the create on, a failure leaves a container of ours to remove
        try:
            if disk is not None:
                disk.mount()
            gofer = be.bind_source_uid(spec.runtime)
            if gofer is not None:
                binds.let_through(gofer)
            body = container_body(be._bound(spec, binds), self.settings, be.facts(), image_id,
                                  unsafe_host_config=be.unsafe_host_config,
                                  command=detached_argv(spec, argv))  # fmt: skip
            # The daemon's log, one file capped like conmon's: what every follower reads.
            body["HostConfig"]["LogConfig"] = {
                "Type": "json-file",
                "Config": {"max-size": str(MAX_LOG_BYTES), "max-file": "1"},
            }
            try:
                got = be.client.api.create_container_from_config(body, name=spec.name)
            except Exception as exc:
                if status_of(exc) == 409:  # a launch that raced ours: not ours to remove
                    raise SandboxError("a sandbox of that name exists already",
                                       sandbox=spec.name) from exc  # fmt: skip
                raise SandboxError(f"docker could not create it: {exc}", sandbox=spec.name) from exc
            made = True
            cid = str(got.get("Id") or spec.name)
            try:
                be.client.api.start(cid)
            except Exception as exc:
                raise SandboxError(f"docker could not start it: {exc}", sandbox=spec.name) from exc
            info = _inspect(be, cid) or {}
            state = info.get("State") if isinstance(info.get("State"), dict) else {}
            init = state.get("Pid") if isinstance(state, dict) else None
            if spec.runtime == "runc":
                if not isinstance(init, int) or init <= 1:
                    raise SandboxError("no init pid to cap its user namespace", sandbox=spec.name)
                try:
                    be._cap_pid(init, spec.name)
                except SandboxError as exc:
                    raise _ended_or(be, cid, spec.name, exc) from exc
                _open_gate(be, cid, spec.uid, spec.name)
            if disk is not None:
                # Settled once the container's init (tini) is gone, by whoever comes first.
                owner, start = _process_start(init)
                disk.hand_over(owner, start)
        except BaseException:
            if made:
                with contextlib.suppress(AgentboxError):
                    be.remove_container(spec.name)
            binds.release()
            if disk is not None:
                with contextlib.suppress(AgentboxError, OSError):
                    disk.release()
            raise
        log_event("launched", spec.name, init=init)

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Stream the sandbox's output from its start into ``log`` and the callbacks until
        it has exited, record the end, then remove it (its bind points and disk too)."""
        del poll  # woken by the Engine's wait, never a poll
        be = self._be()
        info = _inspect(be, name)
        if info is None:
            return self._replay(name, log, on_stdout, on_stderr)
        if not self._ours(name, info):
            raise SandboxGone("not a detached sandbox of this data dir", sandbox=name)
        labels = _labels_of(info)
        try:
            deadline = float(labels.get(DEADLINE_LABEL, "inf"))
        except ValueError:
            deadline = float("inf")
        cid = str(info.get("Id") or name)
        info = self._finish_launch(name, cid, info)
        started = _when(_state(info).get("StartedAt")) or time.time()
        killed = False
        with _LogCopy(log, on_stdout, on_stderr) as copy:
            streamer = threading.Thread(
                target=_stream_logs, args=(be, cid, copy), name=f"agentbox-logs-{name}", daemon=True
            )
            streamer.start()
            while True:
                left = started + deadline - time.time()
                if left <= 0 and not killed:
                    log_event("deadline passed; killing", name)
                    be.kill_container(cid)
                    killed = True
                code = _wait(be, cid, max(1.0, min(left, _WAIT_SLICE)) if not killed else 5.0)
                if code is not None:
                    break
                now = _inspect_quiet(be, cid)
                if now is None or _state(now).get("Running") is not True:
                    break  # ended (or removed by another follower): read below
                if now.get("Id") is None:  # the daemon does not answer (restarting)
                    time.sleep(1.0)
            streamer.join(_DRAIN)
            copy.stop()
            streamer.join(5.0)
        info = _inspect(be, cid)
        if info is None and read_exit(log) is not None:  # another follower ended it
            return self._replay(name, log, None, None, replayed=True)
        state = _state(info or {})
        raw = state.get("ExitCode")
        exit_code = raw if isinstance(raw, int) and info is not None else -1
        finished = _when(state.get("FinishedAt")) or time.time()
        timed_out = killed or (exit_code in (-1, 137) and finished - started >= deadline)
        ended = Exited(137 if timed_out and exit_code == -1 else exit_code, timed_out)
        with _final(log):
            write_exit(log, ended)  # a follower after us replays the log to this end
            self._remove_and_settle(name)
        log_event("followed to its end", name, exit_code=ended.exit_code, timed_out=timed_out)
        return ended

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Whether ``name`` exists, is a detached sandbox of this data dir, sealed by its
        key, and carries each of ``labels`` with the same value."""
        info = _inspect(self._be(), name)
        if info is None or not self._ours(name, info):
            return False
        have = _labels_of(info)
        return all(have.get(k) == v for k, v in labels.items())

    # -- internals

    def _finish_launch(self, name: str, cid: str, info: dict[str, Any]) -> dict[str, Any]:
        """Do what a launcher killed inside :meth:`launch` left undone: start a container
        only created, cap a runc sandbox's user namespace and open its gate, hand its
        workspace disk to its init. Each step is checked first (nothing done twice that
        matters): the agent runs only once the gate opens, and only from here or launch."""
        be = self._be()
        if _state(info).get("Status") == "created":
            log_event("started by its follower (its launcher died before)", name)
            try:
                be.client.api.start(cid)
            except Exception as exc:
                raise SandboxError(f"docker could not start it: {exc}", sandbox=name) from exc
            info = _inspect(be, cid) or info
        state = _state(info)
        init = state.get("Pid")
        if state.get("Running") is not True or not isinstance(init, int) or init <= 1:
            return info
        if _labels_of(info).get("io.agentbox.runtime") == "runc" and not _gate_open(be, cid):
            log_event("gate opened by its follower (its launcher died before)", name)
            try:
                be._cap_pid(init, name)
            except SandboxError:
                # Its init gone since the inspect (killed, or removed by another follower):
                # the container's end, which the caller reads, not a start that failed. A
                # container still running is not capped: that stays an error (fail closed).
                now = _inspect_quiet(be, cid)
                if now is not None and _state(now).get("Running") is True:
                    raise
                log_event("ended before its gate opened", name)
                return now or info
            uid = str(info.get("Config", {}).get("User") or "").partition(":")[0]
            _open_gate(be, cid, int(uid) if uid.isdigit() else 0, name)
        owner, start = _process_start(init)
        record = self.settings.data_dir / "disks" / f"{name}.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            rec = json.loads(record.read_text())
            if rec.get("detached") is True and int(rec["pid"]) != owner and owner:
                rec.update(pid=owner, start=start)
                tmp = record.with_suffix(".tmp")
                tmp.write_text(json.dumps(rec))
                tmp.replace(record)
        return info

    def _be(self) -> DockerBackend:
        return self  # type: ignore[return-value]

    def _ours(self, name: str, info: Mapping[str, Any]) -> bool:
        have = _labels_of(info)
        return (
            str(info.get("Name", "")).lstrip("/") == name
            and have.get(LABEL) == "1"
            and have.get(DETACHED_LABEL) == "1"
            and have.get(OWNER_DATA_LABEL) == data_dir_label(self.settings.data_dir)
            and hmac.compare_digest(have.get(SEAL_LABEL, ""), seal(self.settings, name))
        )

    def _replay(
        self,
        name: str,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        *,
        replayed: bool = False,
    ) -> Exited:
        """No container: a follower before us recorded the end; replay the log, settle."""
        ended = read_exit(log)
        if ended is None:
            raise SandboxGone("no such sandbox (and no record of its end)", sandbox=name)
        with _final(log):
            self._remove_and_settle(name)
        if not replayed:
            with LogReader(log, on_stdout, on_stderr) as reader:
                reader.pump()
        return ended

    def _remove_and_settle(self, name: str) -> None:
        """Remove the container (absent is fine), then its bind points, then settle its
        workspace disk (its init is gone with it)."""
        self._be().remove_container(name)
        HostBinds(self.settings, name).release_all()
        for done in settle_orphan_disks(self.settings, name, exited=True):
            log_event("workspace disk copied back", done)


class _LogCopy:
    """The follower's copy of the output: delivered to the callbacks and written to the
    caller's log (k8s-file records; at :data:`MAX_LOG_BYTES` started over, as conmon's).

    The Engine's stream is read again from its start by each connection: ``skip`` says
    how many bytes of each stream were delivered already (a daemon restart mid-follow).
    """

    def __init__(
        self, log: Path, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
    ) -> None:
        self.log = log
        self._cb = {1: on_stdout, 2: on_stderr}
        self.delivered = {1: 0, 2: 0}
        self._fd = self._open(log)
        self._size = 0
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    @staticmethod
    def _open(path: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path, flags, 0o600)

    def feed(self, stream: int, data: bytes, offset: int) -> None:
        """Bytes ``offset…`` of ``stream`` (1 stdout, 2 stderr) as read this connection."""
        with self._lock:
            if self.stopped.is_set() or stream not in self._cb:
                return
            have = self.delivered[stream]
            if offset + len(data) <= have:
                return
            data = data[max(0, have - offset) :]
            self.delivered[stream] = have + len(data)
            record = format_output("stdout" if stream == 1 else "stderr", data)
            if self._size + len(record) > MAX_LOG_BYTES:
                tmp = self.log.with_name(self.log.name + ".tmp")
                fd = self._open(tmp)
                tmp.replace(self.log)
                os.close(self._fd)
                self._fd, self._size = fd, 0
            os.write(self._fd, record)
            self._size += len(record)
            cb = self._cb[stream]
        if cb is not None:
            cb(data)

    def stop(self) -> None:
        with self._lock:
            self.stopped.set()

    def __enter__(self) -> _LogCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with self._lock:
            os.close(self._fd)


def _stream_logs(be: DockerBackend, cid: str, copy: _LogCopy) -> None:
    """Read ``GET /containers/{id}/logs?follow=1`` into ``copy`` until the container has
    stopped; a connection cut while it runs (dockerd restarting) is made again."""
    tries = 0
    while not copy.stopped.is_set():
        offsets = {1: 0, 2: 0}
        try:
            api = be.client.api
            res = api._get(
                api._url("/containers/{0}/logs", cid),
                params={"stdout": 1, "stderr": 1, "follow": 1, "tail": "all"},
                stream=True,
                timeout=None,
            )
            api._raise_for_status(res)
            raw = res.raw
            try:
                while not copy.stopped.is_set():
                    head = _read_exact(raw, 8)
                    if head is None:
                        break
                    stream, size = head[0], struct.unpack(">I", head[4:])[0]
                    body = _read_exact(raw, size) if size else b""
                    if body is None:
                        break
                    copy.feed(stream, body, offsets.get(stream, 0))
                    offsets[stream] = offsets.get(stream, 0) + len(body)
            finally:
                with contextlib.suppress(Exception):
                    res.close()
        except Exception as exc:  # the daemon went away: ask again below
            log.debug("log stream cut", container=cid, error=str(exc))
        info = _inspect_quiet(be, cid)
        if info is None or _state(info).get("Running") is not True:
            # Stopped: one last read catches what the cut stream had not delivered.
            if tries > 0 or info is None:
                return
            tries += 1
            continue
        time.sleep(1.0)  # running still: the daemon is back (or coming); read again


def _read_exact(raw: Any, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        got = raw.read(n - len(buf))
        if not got:
            return None
        buf += got
    return buf


def _wait(be: DockerBackend, cid: str, timeout: float) -> int | None:
    """The exit code once the container stops, or None: not yet (or the daemon is away)."""
    try:
        got = be.client.api.wait(cid, timeout=timeout, condition="not-running")
    except Exception as exc:
        if status_of(exc) == 404:
            return -1
        return None
    code = got.get("StatusCode") if isinstance(got, dict) else None
    return code if isinstance(code, int) else -1


def _in(be: DockerBackend, cid: str, uid: int, argv: list[str]) -> int | None:
    """Exit code of ``argv`` run in the container as ``uid`` (output dropped)."""
    return exec_stream(be.client, cid, argv, user=f"{uid}:{uid}", workdir="/", env=None,
                       stdin=None, on_stdout=lambda b: None, on_stderr=lambda b: None,
                       timeout=60).exit_code  # fmt: skip


def _open_gate(be: DockerBackend, cid: str, uid: int, name: str) -> None:
    """Touch :data:`GO_FILE` inside: the command behind the gate starts."""
    code = _in(be, cid, uid, ["touch", GO_FILE])
    if code != 0:
        raise SandboxError(f"could not start its command (gate: {code})", sandbox=name)


def _ended_or(be: DockerBackend, cid: str, name: str, exc: SandboxError) -> SandboxError:
    """The error for a failed cap: ``exc`` while the container runs (fail closed), else
    what ended it before its command could start (the Engine's own state, no text the
    sandbox chose: an exit code, the OOM flag, the daemon's error)."""
    now = _inspect_quiet(be, cid)
    state = _state(now or {})
    if now is not None and state.get("Running") is True:
        return exc
    if now is None:
        return SandboxError("it was removed before its command started", sandbox=name)
    code, oom = state.get("ExitCode"), state.get("OOMKilled") is True
    why = f"exit code {code}" if isinstance(code, int) else "no exit code"
    return SandboxError(
        f"it ended before its command started ({why}{', out of memory' if oom else ''})",
        sandbox=name,
    )


def _gate_open(be: DockerBackend, cid: str) -> bool:
    """Whether :data:`GO_FILE` exists in the container (its command started). A container
    that stopped meanwhile needs no gate: its command ran (or it was killed) already."""
    try:
        return _in(be, cid, 65534, ["test", "-e", GO_FILE]) == 0
    except SandboxError:
        info = _inspect(be, cid)
        if info is None or _state(info).get("Running") is not True:
            return True
        raise


def _process_start(pid: object) -> tuple[int, str]:
    """``pid`` and its start as :func:`~agentbox.backends.oci._cli.owner_start` spells it."""
    import psutil

    if not isinstance(pid, int) or pid <= 0:
        return 0, ""
    try:
        return pid, f"{psutil.Process(pid).create_time():.0f}"
    except psutil.Error:
        return 0, ""


@contextlib.contextmanager
def _final(log: Path) -> Iterator[None]:
    """One follower at a time records the end and removes the sandbox (a lock file
    beside the log, in the caller's directory, like the exit marker)."""
    lock = log.with_name(log.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _inspect(be: DockerBackend, ident: str) -> dict[str, Any] | None:
    """``GET /containers/{id}/json``; None when there is no such container."""
    try:
        data = be.client.api.inspect_container(ident)
    except Exception as exc:
        if status_of(exc) == 404:
            return None
        raise SandboxError(f"docker inspect: {exc}", sandbox=ident) from exc
    return data if isinstance(data, dict) else None


def _inspect_quiet(be: DockerBackend, ident: str) -> dict[str, Any] | None:
    """:func:`_inspect`, with a daemon that does not answer read as "still running"."""
    try:
        return _inspect(be, ident)
    except SandboxError:
        return {"Id": None, "State": {"Running": True}}


def _state(info: Mapping[str, Any]) -> dict[str, Any]:
    state = info.get("State")
    return state if isinstance(state, dict) else {}


def _labels_of(info: Mapping[str, Any]) -> dict[str, str]:
    config = info.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if not isinstance(labels, dict):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def _when(stamp: object) -> float | None:
    """An Engine time (RFC 3339, nanoseconds) as epoch seconds; None when unset."""
    if not isinstance(stamp, str) or not stamp or stamp.startswith("0001-"):
        return None
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    digits = "".join(c for c in frac if c.isdigit())
    return base + (float("0." + digits) if digits else 0.0)


def log_event(what: str, name: str, **kw: object) -> None:
    log.info(what, sandbox=name, **kw)
