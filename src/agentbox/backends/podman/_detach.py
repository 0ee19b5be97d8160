"""Detached podman sandboxes: nothing of ours attached, re-adoptable by a new launcher.

:meth:`~PodmanDetached.launch` is ``podman run -d`` (no ``--rm``) with the same
hardening as ``run`` (:func:`~agentbox.backends.oci._args.run_args`); the podman
client exits as soon as the container runs and **conmon alone holds it** (about
2 MiB, against the attached client's 35 MiB). conmon is a daemon of its own
(parent 1, its own session and process group) and its ``--timeout`` kills the
sandbox at its deadline whether or not any launcher lives. Its output goes to the
caller's log in conmon's ``k8s-file`` format, capped at
:data:`~agentbox.backends.base.MAX_LOG_BYTES` (at the cap conmon starts the file
over: the *last* part is kept; see :mod:`agentbox.backends._k8slog`).

cgroups: under the cgroupfs manager on a v1/hybrid host, podman moves conmon out
of its caller's cgroup in every v1 *controller* hierarchy (to
``/libpod_parent/conmon``), but leaves it in the caller's ``name=systemd`` and
unified (``0::``) cgroups, the ones systemd tracks a unit by: a ``systemctl
restart`` of the launcher's unit would kill it. So ``podman run -d`` runs through
:func:`born_outside`: podman and its conmon start in ``libpod_parent/conmon`` of
those hierarchies, with no window in which a unit kill reaches conmon;
:func:`place_conmon` moves a stray one there after the start and on every follow.

:meth:`~PodmanDetached.follow`, from any process, reads the log from its start
and watches conmon (no podman client held: one short ``podman inspect`` at the
start), woken by conmon's pidfd or its exit file (:mod:`._exitfile`), never a
fixed poll; past the deadline it kills the sandbox itself too. The end is read
from conmon's exit file the moment the container exits (a ``podman inspect``
only when conmon died without one); the follower records how (``<log>.exit``),
then, once conmon has finished podman's cleanup and gone, settles the workspace disk
(copied back, unmounted) and returns while the container is removed off the caller's
path (:mod:`._removals`).
:meth:`~PodmanDetached.adoptable` checks name, labels, the data dir and a seal
only this data dir's key makes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agentbox.backends._detached import check_launch, detach_key
from agentbox.backends._k8slog import LogReader, exit_marker, read_exit, write_exit
from agentbox.backends._wsdisk import WorkspaceDisk, disk_left, settle_orphan_disks
from agentbox.backends.base import (
    LABEL,
    MAX_LOG_BYTES,
    OWNER_DATA_LABEL,
    Exited,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.oci._args import (
    check_spec,
    entry_argv,
    forget_image,
    image_facts,
    run_args,
)
from agentbox.backends.oci._cli import conmon_cwd, env_file, force_remove, kill
from agentbox.backends.podman import _launched, _removals
from agentbox.backends.podman._cgroup import born_outside, place_conmon
from agentbox.backends.podman._exitfile import (
    CONMON_EXIT_WAIT,
    _end_orphan,
    _ended,
    _running,
    _state,
    _when,
    exit_file_of,
    read_exit_file,
    wait_exited,
)
from agentbox.backends.podman._pool_view import pool_log, pool_view
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, CommandError, SandboxError, SandboxGone
from agentbox.linux.wake import Wake

logger = get_logger(__name__)

#: Set ("1") on a detached sandbox: orphan sweeps leave it to its data dir's launcher.
DETACHED_LABEL = "io.agentbox.detached"
#: The spec's deadline in seconds (the follower kills at StartedAt + this).
DEADLINE_LABEL = "io.agentbox.deadline"
#: HMAC of the name and data dir under the data dir's key: made by us, for this data dir.
SEAL_LABEL = "io.agentbox.seal"


class PodmanDetached:
    """Mixed into :class:`~agentbox.backends.podman.PodmanBackend`: the detached verbs."""

    settings: Settings
    unsafe_extra_args: tuple[str, ...]
    #: A launch's or pool claim's view of its sandbox, for follow's start (_launched.py).
    claimed: dict[str, dict[str, Any]]

    if TYPE_CHECKING:

        def _labels(self, spec: SandboxSpec) -> SandboxSpec: ...

    def detaches(self, runtime: str) -> bool:
        """True for every OCI runtime: conmon monitors runc, crun and runsc alike."""
        del runtime
        return True

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """``podman run -d``: see the module docstring. Returns once the sandbox runs.

        The log is conmon's ``k8s-file``; at :data:`MAX_LOG_BYTES` conmon starts it
        over, so it keeps the *last* part of the output (a follower that keeps up
        loses nothing). ``<log>.exit`` and ``<log>.lock`` beside it are the
        follower's. A name that exists already is refused (``SandboxError``) and
        nothing of that sandbox is touched.
        """
        check_launch(argv, log)
        facts = check_spec(spec, subid_base=self.settings.sandbox_subid_base)
        assert facts is not None
        spec = self._labels(spec)
        labels = {
            **spec.labels,
            OWNER_DATA_LABEL: data_dir_label(self.settings.data_dir),
            DETACHED_LABEL: "1",
            DEADLINE_LABEL: f"{spec.deadline:g}",
            SEAL_LABEL: seal(self.settings, spec.name),
        }
        spec = spec.replace(labels=labels)
        stale = [p for p in (log, exit_marker(log), log.with_name(log.name + ".tmp")) if p.exists()]
        if stale and inspect(spec.name) is not None:  # else podman refuses a name in use
            # Never touch another sandbox's log, disk or container (a task launched twice).
            raise SandboxError("a sandbox of that name exists already", sandbox=spec.name)
        for path in stale:
            path.unlink(missing_ok=True)
        disk = None
        ran = False  # from podman run on, a failure leaves a container of ours to remove
        if spec.workspace is not None:
            limit = spec.resources.disk_limit(self.settings)
            disk = WorkspaceDisk(self.settings, spec.name, spec.workspace, limit, detached=True)
        try:
            if disk is not None:
                disk.mount()
            with env_file(spec.env) as envf:
                args = run_args(
                    spec,
                    self.settings,
                    facts,
                    detach=True,
                    env_file=envf.path,
                    log=log,
                    log_max=MAX_LOG_BYTES,
                    unsafe_extra_args=self.unsafe_extra_args,
                )
                args += entry_argv(spec, argv)
                args, pidfile = _launched.with_pidfile(args, spec.name)
                try:
                    ran, started = True, time.time()  # started: no later than podman's
                    res = _proc.run(born_outside(args), timeout=120, cwd=conmon_cwd())
                except CommandError as exc:
                    pidfile.unlink(missing_ok=True)
                    if "already in use" in exc.stderr:  # a launch that raced ours: not ours
                        ran = False
                    if "image not known" in exc.stderr:
                        forget_image(spec.image)
                        image_facts(spec.image, refresh=True)  # raises ImageError
                    raise SandboxError(f"could not start: {exc}", sandbox=spec.name) from exc
                if "agentbox: could not enter" in res.stderr:
                    logger.warning("conmon born in our cgroup", sandbox=spec.name, why=res.stderr)
            conmon, view = _launched.conmon_and_view(res.stdout, pidfile, spec, started)
            if view is not None:
                self.claimed[spec.name] = view
            else:  # not known for sure from podman's answer: ask it
                conmon = conmon_of(inspect(spec.name) or {})
            if conmon is not None:
                place_conmon(conmon.pid)
            if disk is not None:
                # Settled once conmon is gone (the sandbox exited), by whoever comes first.
                start = f"{conmon.create_time():.0f}" if conmon is not None else ""
                disk.hand_over(conmon.pid if conmon is not None else 0, start)
        except BaseException:
            if ran:
                with contextlib.suppress(AgentboxError):
                    force_remove(spec.name)
            if disk is not None:
                with contextlib.suppress(AgentboxError, OSError):
                    disk.release()
            raise
        log_event("launched", spec.name, conmon=conmon.pid if conmon is not None else None)

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Stream ``log`` from its start until the sandbox has exited, then remove it."""
        info = getattr(self, "claimed", {}).pop(name, None) or inspect(name)  # a pool claim's
        if info is None:
            return self._replay(name, log, on_stdout, on_stderr)
        if not self._ours(name, info):
            raise SandboxGone("not a detached sandbox of this data dir", sandbox=name)
        labels = _labels_of(info)
        try:
            deadline = float(labels.get(DEADLINE_LABEL, "inf"))
        except ValueError:
            deadline = float("inf")
        started = _when(_state(info).get("StartedAt")) or time.time()
        conmon = conmon_of(info)
        if conmon is not None:
            place_conmon(conmon.pid)  # a stray conmon (born in our unit) leaves it now
        killed = orphaned = False
        exit_file = exit_file_of(conmon, info)
        early: tuple[int, float] | None = None
        with (
            LogReader(pool_log(info, log), on_stdout, on_stderr) as reader,
            _waking(
                conmon.pid if conmon else None, exit_file.parent if exit_file else None
            ) as wake,
        ):
            while True:
                reader.pump()
                if time.time() >= started + deadline and not killed:
                    log_event("deadline passed; killing", name)
                    _removals.await_rename(name)
                    kill(name)
                    killed = True
                if conmon is not None and _running(conmon):
                    # The exit file is the end, before conmon's cleanup and exit.
                    if (early := read_exit_file(exit_file)) is not None:
                        break
                    wake.wait(poll)  # conmon's exit or the exit file wakes it at once
                    continue
                # conmon is gone: the sandbox exited (or conmon was killed: ask podman).
                info = inspect(name)
                if info is None:  # another follower removed it meanwhile
                    break
                if _state(info).get("Running") is True:
                    conmon = conmon_of(info)
                    if conmon is None:  # killed under a live sandbox: nobody would end it
                        orphaned = True
                        _end_orphan(name, info)
                        info = inspect(name)
                        break
                    time.sleep(max(poll, 1.0))
                    continue
                break
            if early is not None:
                ended = _ended(early[0], early[1], started, deadline, killed=killed)
                with self._final(log):
                    write_exit(log, ended)  # a caller's stop steps may start (the gateway's)
                    # conmon drains the output into the log before it writes the exit file,
                    # then runs podman's cleanup (a podman process) and exits: neither the
                    # rest of the log nor the disk waits for that; the removal does.
                    reader.pump()
                    self._remove_and_settle(name, conmon)
                log_event("followed to its end", name, exit_code=ended.exit_code, early=True)
                return ended
            reader.pump()
            if info is None:
                reader.close()
                return self._replay(name, log, None, None, replayed=True)
        state = _state(info)
        code = state.get("ExitCode")
        # An orphan's exit code died with its conmon (podman's 0 is only its default).
        exit_code = code if isinstance(code, int) and not orphaned else -1
        finished = _when(state.get("FinishedAt")) or time.time()
        ended = _ended(exit_code, finished, started, deadline, killed=killed)
        with self._final(log):
            write_exit(log, ended)
            if conmon is not None:  # it exited (its conmon is gone): off the caller's path
                _removals.remove_later(name)
            else:  # an orphan's: removed first, then its disk is settled
                force_remove(name)
            self._settle(name, conmon)
        log_event("followed to its end", name, exit_code=ended.exit_code, timed_out=ended.timed_out)
        return ended

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Whether ``name`` exists, is a detached sandbox of this data dir, sealed by its
        key, and carries each of ``labels`` with the same value."""
        info = inspect(name)
        if info is None or not self._ours(name, info):
            return False
        conmon = conmon_of(info)
        if conmon is not None:
            place_conmon(conmon.pid)  # an adopter fixes a conmon left in the old unit
        have = _labels_of(info)
        return all(have.get(k) == v for k, v in labels.items())

    # -- internals

    def _ours(self, name: str, info: Mapping[str, Any]) -> bool:
        have = _labels_of(info)
        want_seal = seal(self.settings, name)
        return (
            _name_of(info) == name
            and have.get(LABEL) == "1"
            and have.get(DETACHED_LABEL) == "1"
            and have.get(OWNER_DATA_LABEL) == data_dir_label(self.settings.data_dir)
            and hmac.compare_digest(have.get(SEAL_LABEL, ""), want_seal)
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
            self._settle(name, None)  # nobody will follow it: its disk is not left mounted
            raise SandboxGone("no such sandbox (and no record of its end)", sandbox=name)
        with self._final(log):
            self._settle(name, None)
        if not replayed:
            with LogReader(log, on_stdout, on_stderr) as reader:
                reader.pump()
        return ended

    @contextlib.contextmanager
    def _final(self, log: Path) -> Iterator[None]:
        """One follower at a time removes the sandbox and copies its disk back (a lock
        file beside the log, in the caller's directory, like the exit marker)."""
        lock = log.with_name(log.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _settle(self, name: str, conmon: psutil.Process | None, *, ended: bool = False) -> None:
        """Settle the workspace disk once the end was seen. ``ended``: from conmon's exit
        file (every process of the sandbox gone): conmon's own exit is not waited for."""
        if conmon is not None and not ended:
            wait_exited(conmon, CONMON_EXIT_WAIT)
        # Called once the end was seen: with its conmon gone too, the sandbox has exited
        # and its disk is settled whether or not its container is removed yet.
        exited = conmon is not None and not _running(conmon)
        for done in settle_orphan_disks(self.settings, name, exited=exited, ended=ended):
            log_event("workspace disk copied back", done)
        if disk_left(self.settings, name):
            # Its owner (conmon, finishing podman's cleanup) or its container outlived
            # the wait: settled once both are gone, not left to the next launcher's start.
            settle_when_gone(self.settings, name)

    def _remove_and_settle(self, name: str, conmon: psutil.Process | None) -> None:
        """After the exit file: ``podman rm`` off the caller's path (:mod:`._removals`,
        once conmon has run podman's cleanup and gone) while the disk is copied back now:
        neither needs the other, and nothing of the task needs the container. The disk
        first: the remover (a process, and its interpreter's start on the host's cores)
        waits for conmon anyway, which outlives the copy back."""
        try:
            self._settle(name, conmon, ended=True)
        finally:
            _removals.remove_later(name, after=conmon)


@contextlib.contextmanager
def _waking(pid: int | None, directory: Path | None) -> Iterator[Wake]:
    """A :class:`Wake` for the ``with`` block, closed on a thread of its own: closing an
    inotify instance waits for the kernel's fsnotify grace period (10-20 ms on a busy
    host), which the task's end need not wait for."""
    wake = Wake(pid, directory)
    try:
        yield wake
    finally:
        try:
            threading.Thread(target=wake.close, name="agentbox-wake-close", daemon=True).start()
        except RuntimeError:  # no thread to be had (interpreter shutting down)
            wake.close()


#: How long :func:`settle_when_gone` keeps trying (then the next launcher's start settles).
LATE_SETTLE_FOR = 300.0
_late_lock = threading.Lock()
_late: dict[str, threading.Thread] = {}


def settle_when_gone(settings: Settings, name: str, *, every: float = 1.0) -> threading.Thread:
    """Settle sandbox ``name``'s workspace disk once its recorded owner and its container
    are both gone (a daemon thread of this process, at most :data:`LATE_SETTLE_FOR`
    seconds; one per name). :func:`settle_orphan_disks` makes the decision each time, so
    a disk whose sandbox still runs is never touched."""

    def run() -> None:
        until = time.monotonic() + LATE_SETTLE_FOR
        try:
            while disk_left(settings, name) and time.monotonic() < until:
                time.sleep(every)
                try:
                    for done in settle_orphan_disks(settings, name):
                        log_event("workspace disk copied back after its owner", done)
                except (AgentboxError, OSError) as exc:
                    logger.warning("could not settle a workspace disk yet", sandbox=name,
                                   error=str(exc)[-500:])  # fmt: skip
        finally:
            with _late_lock:
                if _late.get(name) is threading.current_thread():
                    del _late[name]

    with _late_lock:
        if (thread := _late.get(name)) is not None and thread.is_alive():
            return thread
        thread = threading.Thread(target=run, name=f"agentbox-settle-{name}", daemon=True)
        _late[name] = thread
        thread.start()
        return thread


def log_event(what: str, name: str, **kw: object) -> None:
    logger.info(what, sandbox=name, **kw)


def seal(settings: Settings, name: str) -> str:
    """HMAC-SHA256 of ``name`` and the data dir under ``data_dir/detach.key`` (0600, made
    on first use): a container labelled by hand, or by another data dir, lacks it."""
    msg = f"{name}\0{data_dir_label(settings.data_dir)}".encode()
    return hmac.new(detach_key(settings), msg, hashlib.sha256).hexdigest()[:32]


def inspect(name: str) -> dict[str, Any] | None:
    """``podman container inspect`` of ``name``; None when there is no such container."""
    _removals.await_rename(name)  # a claim of this process names it (see _removals)
    res = _proc.run(
        ["podman", "container", "inspect", "--format", "json", name], timeout=60, check=False
    )
    if res.returncode != 0:
        # "container not known": caught while another process (a dead launcher's
        # `podman rm`, which outlives it) removes it; gone all the same.
        err = res.stderr.lower()
        if "no such" in err or "container not known" in err:
            return None
        if "layer not known" in err:
            # A `podman rm` cut short (killed with its launcher) leaves the record
            # of a container whose storage is gone ("Removing"): finish it; gone as above.
            force_remove(name)
            return None
        raise SandboxError(f"podman inspect failed: {res.stderr.strip()[-500:]}", sandbox=name)
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise SandboxError(f"podman inspect gave no JSON: {exc}", sandbox=name) from exc
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    return pool_view(data[0])  # a claimed pool sandbox: as its task sees it


def is_detached(info: Mapping[str, Any]) -> bool:
    """Whether an inspected container was made by ``launch``."""
    return _labels_of(info).get(DETACHED_LABEL) == "1"


def _labels_of(info: Mapping[str, Any]) -> dict[str, str]:
    config = info.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if not isinstance(labels, dict):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def _name_of(info: Mapping[str, Any]) -> str:
    return str(info.get("Name", "")).lstrip("/")


def conmon_of(info: Mapping[str, Any]) -> psutil.Process | None:
    """The live conmon of an inspected container (checked to be a conmon), or None."""
    pid = _state(info).get("ConmonPid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.name() != "conmon":
            return None
    except psutil.Error:
        return None
    return proc
