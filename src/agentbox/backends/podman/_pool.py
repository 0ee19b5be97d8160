"""A warm pool of hardened podman sandboxes: started ahead, claimed by one task each.

A pooled sandbox is started by :func:`fill` with the very flags of a fresh one
(:func:`~agentbox.backends.oci._args.run_args`: uid 64000, no capabilities,
read-only root, no network, the seccomp profile, the limits), detached under conmon
like :meth:`~agentbox.backends.podman._detach.PodmanDetached.launch`, but before
its task exists. Its slot, ``data_dir/pool/slots/<slot>/``, holds two empty
directories bind-mounted as its ``/workspace`` and gateway directory with
``rslave`` propagation (the pool dir is a shared mount of itself), and the log
conmon writes. Its main process, under tini as always, is a stub that waits for a
go-file (named by a random token) in its empty ``/workspace``. Its workspace disk is
made too, empty, and mounted at a private stage (:mod:`._pool_disk`).

:func:`claim` (from ``launch``, for a spec of the pool's shape) takes a ready slot
by an atomic rename (``ready`` -> ``claimed``: of two claimers one wins, in any
processes), writes the claim record (the task's labels and seal, the claim time: see
:mod:`~agentbox.backends.podman._pool_view`), renames the container to the task's
sandbox name (a podman client, concurrently with what follows), fills the slot's
workspace disk with the task's workspace and moves it over it (the disk ``launch``
would make), binds the task's gateway directory onto the slot's
(``nosuid,nodev,noexec``), writes the go-file (argv behind the relay, environment,
workdir), and last binds the workspace onto the slot's (``nosuid,nodev``). The mount
propagates into the sandbox and hides the go-file: then the stub ``chdir``\\ s into
the new ``/workspace`` and ``exec``\\ s the task's command. ``launch`` returns then,
the rename going on off the task's path (:mod:`._removals`: this process's by-name
calls wait for it); from there the sandbox is a detached one: ``follow``, adoption,
``kill`` and ``reap`` work on it by name.

Single use: a claimed sandbox ends with its task; its slot is released (binds
unmounted, directory removed) when its follower settles it (:func:`release`).
Deadline: the follower counts the task's deadline from the claim; conmon's own
``--timeout`` (the launcher-independent backstop) counts from the pool start, so it
is set to ``ttl + max deadline``: a claim takes only an entry younger than its ttl
and a task whose deadline is at most the pool's, so the backstop fires at most
``ttl`` after the task's deadline. Entries older than ``ttl`` are removed by
:func:`sweep`; :func:`drain` removes every unclaimed one. Pool sandboxes carry the
data dir's owner label: a next launcher's orphan sweep reaps those of a dead one.

Only runc and crun (gVisor does not receive mount propagation), only specs with a
workspace, and never with ``unsafe_extra_args`` (the escape suite's controls).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agentbox.backends._uidslots import claim as claim_uid_slot
from agentbox.backends._uidslots import release as release_uid_slot
from agentbox.backends._uidslots import reown, slot_base, transfer
from agentbox.backends.base import (
    MAX_LOG_BYTES,
    OWNER_DATA_LABEL,
    WORKSPACE_IN_SANDBOX,
    SandboxSpec,
    data_dir_label,
)
from agentbox.backends.oci._args import check_spec, entry_argv, run_args
from agentbox.backends.oci._cli import conmon_cwd, env_file, force_remove
from agentbox.backends.podman import _pool_disk, _removals
from agentbox.backends.podman._cgroup import born_outside, place_conmon
from agentbox.backends.podman._detach import (
    DEADLINE_LABEL,
    DETACHED_LABEL,
    SEAL_LABEL,
    conmon_of,
    inspect,
    seal,
)
from agentbox.backends.podman._launched import container_id, started_conmon, with_pidfile
from agentbox.backends.podman._pool_slots import (
    SLOT_PREFIX,
    alive,
    bind,
    discard,
    filler,
    locked,
    pool_dir,
    share,
    slot_log,
    slots,
    unbind,
    write,
)
from agentbox.backends.podman._pool_view import (
    POOL_DIR_LABEL,
    POOL_LABEL,
    POOL_LOG_KEY,
    POOL_NAME_LABEL,
)
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.core.tally import POOL_CLAIMS, count_one
from agentbox.errors import AgentboxError, CommandError, ConfigError, SandboxError

if TYPE_CHECKING:
    from agentbox.backends.podman._backend import PodmanBackend

log = get_logger(__name__)

#: A claim leaves an entry this close to its expiry alone (it is about to be swept).
EXPIRY_MARGIN = 15.0
POOL_RUNTIMES = ("runc", "crun")

# The stub: wait for the go-file, then for the workspace mount to hide it, then
# chdir into the new /workspace and exec the task's command (argv, env on top of
# the container's own, as --env-file puts it). Reads only a file the host wrote.
# The go-file is read through a descriptor of the slot's directory opened first
# (``fill`` waits until the stub holds it): the claim writes the go-file, then binds
# the workspace over that directory at once, and a stub that looked by path only
# after the bind (descheduled on a busy host) never saw it and idled to the deadline.
_STUB = """\
import json, os, sys, time
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
p = os.path.join(sys.argv[1], sys.argv[2])
while True:
    try:
        with open(sys.argv[2], 'rb', opener=lambda n, f: os.open(n, f, dir_fd=d)) as f:
            g = json.loads(f.read())
        break
    except (OSError, ValueError):
        time.sleep(0.005)
os.close(d)
while os.path.lexists(p):
    time.sleep(0.002)
os.chdir(g['workdir'])
env = dict(os.environ)
env.update(g['env'])
try:
    os.execvpe(g['argv'][0], g['argv'], env)
except OSError as e:
    sys.stderr.write('agentbox: cannot run %s: %s\\n' % (g['argv'][0], e))
    os._exit(127)
"""


def pool_key(spec: SandboxSpec, settings: Settings, image_id: str) -> str:
    """The shape of a sandbox: what must be equal for a pooled one to serve ``spec``."""
    shape = [
        image_id,
        spec.runtime,
        spec.isolation,
        repr(spec.resources),
        spec.uid,
        spec.workdir,
        settings.subid_base,  # the pool's base: each pooled sandbox has a uid slot of its own
        spec.gateway_dir is not None,
        [(str(m.source), m.target, m.read_only) for m in spec.mounts],
    ]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def fill(backend: PodmanBackend, template: SandboxSpec, size: int, *, ttl: float) -> list[str]:
    """Start pooled sandboxes of ``template``'s shape until ``size`` are ready; return
    the names started. ``template.deadline`` is the longest deadline they serve."""
    settings = backend.settings
    if template.runtime not in POOL_RUNTIMES or backend.unsafe_extra_args:
        raise ConfigError(f"no pool for runtime {template.runtime} or a weakened backend")
    facts = check_spec(template, subid_base=settings.sandbox_subid_base)
    assert facts is not None
    key = pool_key(template, settings, facts.id)
    started: list[str] = []
    with locked(settings) as root:
        share(root)
        ready = [r for _, r in slots(root) if r is not None and r.get("key") == key]
        for _ in range(max(0, size - len(ready))):
            started.append(_start_one(backend, template, root, key, ttl, facts))
    return started


def _start_one(
    backend: PodmanBackend, template: SandboxSpec, root: Path, key: str, ttl: float, facts: Any
) -> str:
    settings = backend.settings
    slot = SLOT_PREFIX + secrets.token_hex(6)
    sdir = root / "slots" / slot
    for d in (sdir, sdir / "ws", sdir / "gw"):
        d.mkdir(mode=0o755)
    go = f".agentbox-go-{secrets.token_hex(8)}"
    spec = template.replace(
        name=slot,
        workspace=sdir / "ws",
        gateway_dir=sdir / "gw" if template.gateway_dir is not None else None,
        env={},
        deadline=ttl + template.deadline,
    )
    spec = backend._labels(spec)
    labels = {
        **spec.labels,
        OWNER_DATA_LABEL: data_dir_label(settings.data_dir),
        DETACHED_LABEL: "1",
        DEADLINE_LABEL: f"{spec.deadline:g}",
        SEAL_LABEL: seal(settings, slot),
        POOL_LABEL: key,
        POOL_DIR_LABEL: str(root),
        POOL_NAME_LABEL: slot,
    }
    spec = spec.replace(labels=labels)
    created = time.time()
    # A host uid range of its own from birth; a claim hands it to the task it serves.
    uid_slot = claim_uid_slot(settings, slot)
    try:
        with env_file({}) as envf:
            args = run_args(
                spec,
                settings.for_slot(uid_slot),
                facts,
                detach=True,
                env_file=envf.path,
                log=slot_log(root, slot),
                log_max=MAX_LOG_BYTES,
            )
            # The slot's mounts receive what the host mounts under them at claim.
            for i, a in enumerate(args):
                if a.startswith((f"{sdir / 'ws'}:", f"{sdir / 'gw'}:")):
                    args[i] = a + ",rslave"
            args += ["python3", "-I", "-S", "-c", _STUB, WORKSPACE_IN_SANDBOX, go]
            args, pidfile = with_pidfile(args, slot)
            try:
                res = _proc.run(born_outside(args), timeout=120, cwd=conmon_cwd())
            except BaseException:  # else started_conmon reads and removes it
                pidfile.unlink(missing_ok=True)
                raise
        cid = container_id(res.stdout) or ""
        # conmon from its pid file (no podman inspect); asked of podman if not sure.
        conmon = started_conmon(pidfile, cid or None) or conmon_of(inspect(slot) or {})
        if conmon is None:
            raise SandboxError("the pooled sandbox has no conmon", sandbox=slot)
        place_conmon(conmon.pid)
        _wait_stub(conmon, slot)
        disk = _staged_disk(settings, template, slot)
    except BaseException:
        with contextlib.suppress(AgentboxError):
            force_remove(slot)
        shutil.rmtree(sdir, ignore_errors=True)
        _pool_disk.drop(settings.data_dir, slot)
        release_uid_slot(settings, slot)
        raise
    ready = {
        "key": key,
        "uid_slot": uid_slot,
        "id": cid,
        "go": go,
        "created": created,
        "expires": created + ttl,
        "max_deadline": template.deadline,
        "conmon": conmon.pid,
        "conmon_start": conmon.create_time(),
        "disk": disk,
        # Whose pool it is: another launcher's orphan sweep leaves it be while this
        # process lives (a foreground `agentbox run` beside the service's keeper).
        **filler(),
    }
    write(sdir / "ready", ready, mode=0o600)
    log.info("pool sandbox ready", sandbox=slot, key=key)
    return slot


def _staged_disk(settings: Settings, template: SandboxSpec, slot: str) -> dict[str, Any] | None:
    """The slot's workspace disk made now, off the task's path (None: a claim makes it)."""
    try:
        return _pool_disk.make(settings, slot, template.resources.disk_limit(settings))
    except (AgentboxError, OSError) as exc:
        log.warning("no staged workspace disk for a pool slot", sandbox=slot, error=str(exc))
        return None


def claim(
    backend: PodmanBackend, spec: SandboxSpec, argv: Sequence[str], *, log_path: Path
) -> bool:
    """Serve ``spec`` from the pool if a ready sandbox of its shape waits; True if it
    now runs ``argv`` (as ``launch`` would), False to take the fresh path."""
    settings = backend.settings
    root = pool_dir(settings)
    if (
        settings.pool_size <= 0
        or backend.unsafe_extra_args
        or spec.runtime not in POOL_RUNTIMES
        or spec.workspace is None
        or not argv
        or not (root / "slots").is_dir()
    ):
        return False
    facts = check_spec(spec, subid_base=settings.sandbox_subid_base)
    assert facts is not None
    key = pool_key(spec, settings, facts.id)
    now = time.time()
    for sdir, ready in slots(root):
        if (
            ready is None
            or ready.get("key") != key
            or not isinstance(ready.get("uid_slot"), int)  # an older pool's: shared ids
            or float(ready.get("expires", 0)) < now + EXPIRY_MARGIN
            or float(ready.get("max_deadline", 0)) < spec.deadline
        ):
            continue
        try:
            (sdir / "ready").rename(sdir / "claimed")  # the atomic claim: one wins
        except OSError:
            continue
        if not alive(ready):
            discard(sdir)
            release_uid_slot(settings, sdir.name)
            continue
        try:
            _bind_task(backend, spec, argv, sdir, ready, log_path)
        except _NotStarted as exc:  # nothing of the task ran: the fresh path instead
            log.warning("pool claim failed; starting fresh", sandbox=spec.name, error=str(exc))
            return False
        count_one(root / POOL_CLAIMS)  # agentbox_pool_claims_total
        return True
    return False


#: How long ``fill`` waits for a new pooled sandbox's stub to hold its directory.
STUB_WAIT = 60.0


def _wait_stub(conmon: psutil.Process, slot: str) -> None:
    """Return once the stub (conmon's child tini's child) holds ``/workspace`` open: from
    then a claim's go-file reaches it however late it looks (see ``_STUB``)."""
    end = time.monotonic() + STUB_WAIT
    while time.monotonic() < end:
        with contextlib.suppress(psutil.Error, OSError):
            for proc in conmon.children(recursive=True):
                for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
                    if str(fd.readlink()) == WORKSPACE_IN_SANDBOX:
                        return
        time.sleep(0.01)
    raise SandboxError("the pooled sandbox's stub never opened its workspace", sandbox=slot)


class _NotStarted(Exception):
    """A claim failed before the task's command could start (all of it undone)."""


def _stage(settings: Settings, slot: str, what: str) -> Path:
    """Where a slot's bind is made before it moves in: the data dir (private), not the
    pool dir (shared: a move out of a shared mount is refused)."""
    return settings.data_dir / f".pool-stage-{slot}-{what}"


def _bind_task(
    backend: PodmanBackend,
    spec: SandboxSpec,
    argv: Sequence[str],
    sdir: Path,
    ready: dict[str, Any],
    log_path: Path,
) -> None:
    settings = backend.settings
    root, slot = sdir.parent.parent, sdir.name
    spec = backend._labels(spec)
    labels = {
        **spec.labels,
        OWNER_DATA_LABEL: data_dir_label(settings.data_dir),
        DETACHED_LABEL: "1",
        DEADLINE_LABEL: f"{spec.deadline:g}",
        SEAL_LABEL: seal(settings, spec.name),
    }
    assert spec.workspace is not None
    disk = _pool_disk.PrebuiltDisk(
        settings,
        spec.name,
        spec.workspace,
        spec.resources.disk_limit(settings),
        slot=slot,
        staged=ready.get("disk"),
        detached=True,
    )
    record = root / "claims" / f"{spec.name}.json"
    renamed = triggered = False
    # The task's files follow to the pooled sandbox's own uid (its slot becomes the task's).
    task_uid = settings.sandbox_host_uid
    pool_uid = slot_base(settings, int(ready["uid_slot"])) + spec.uid
    mine = [d for d in (spec.workspace, spec.gateway_dir) if d is not None]
    try:
        for d in mine:
            reown(d, task_uid, pool_uid)
        (root / "claims").mkdir(mode=0o700, exist_ok=True)
        rec = {
            "id": ready["id"],
            "slot": slot,
            "labels": labels,
            "claimed_at": time.time(),
            "log": str(slot_log(root, slot)),
            "task_log": str(log_path),
        }
        write(record, rec, mode=0o600)
        # The rename (a podman client, the slowest step) runs while the disk is made and
        # the command starts, and goes on after the claim returns (``_removals``): a name
        # in use fails it, and the claim is undone (the disk check below refuses the usual
        # case, a task launched twice, before any start).
        done = threading.Event()
        failed: list[CommandError] = []

        def rename() -> None:
            try:
                _proc.run(["podman", "rename", slot, spec.name], timeout=60)
            except CommandError as exc:
                failed.append(exc)
                if triggered:  # the task's command may run: rename_later ends it
                    raise SandboxError(f"podman rename failed: {exc}", sandbox=spec.name) from exc
            finally:
                done.set()

        _removals.rename_later(spec.name, str(ready["id"]) or slot, rename)
        try:
            disk.mount()
            if spec.gateway_dir is not None:
                stage = _stage(settings, slot, "gw")
                bind(spec.gateway_dir, sdir / "gw", "nosuid,nodev,noexec", stage=stage)
            for stale in (log_path, log_path.with_name(log_path.name + ".exit")):
                stale.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another filesystem: copied at release
                os.link(slot_log(root, slot), log_path)
            if failed:  # nothing of the task ran yet: the fresh path instead
                raise SandboxError(f"podman rename failed: {failed[0]}", sandbox=spec.name)
            go = {"argv": entry_argv(spec, argv), "env": dict(spec.env), "workdir": spec.workdir}
            write(sdir / "ws" / ready["go"], go, mode=0o644)
            triggered = True  # from here the task may run: never started again elsewhere
            stage = _stage(settings, slot, "ws")
            bind(spec.workspace, sdir / "ws", "nosuid,nodev", stage=stage)
        except BaseException:
            done.wait(120)  # the undo below removes it by id, under whichever name
            renamed = not failed
            raise
        if done.is_set() and failed:  # failed before the command was triggered
            raise SandboxError(
                f"could not claim a pooled sandbox: {failed[0]}", sandbox=spec.name
            ) from failed[0]
        disk.hand_over(int(ready["conmon"]), f"{float(ready['conmon_start']):.0f}")
    except (AgentboxError, OSError) as exc:
        with contextlib.suppress(AgentboxError):
            force_remove(str(ready["id"]) or (spec.name if renamed else slot))
        unbind(sdir)
        with contextlib.suppress(AgentboxError, OSError):
            disk.release()
        record.unlink(missing_ok=True)
        discard(sdir)
        release_uid_slot(settings, slot)
        if triggered:
            raise
        for d in mine:  # the fresh path runs it under the task's own slot again
            reown(d, pool_uid, task_uid)
        raise _NotStarted(str(exc)) from exc
    release_uid_slot(settings, spec.name)  # the task's own slot: free again
    transfer(settings, slot, spec.name)
    backend.claimed[spec.name] = {
        "Id": ready["id"],
        "Name": spec.name,
        "Config": {"Labels": labels},
        "State": {
            "Running": True,
            "ConmonPid": int(ready["conmon"]),
            "StartedAt": datetime.fromtimestamp(float(rec["claimed_at"]), UTC).isoformat(),
        },
        POOL_LOG_KEY: str(slot_log(root, slot)),
    }
    log.info("pool sandbox claimed", sandbox=spec.name, slot=slot)


# -- internals
