"""The setup phase, and egress for a phase: what runs before the agent, and how it gets out.

:func:`prepare_env` turns a task's ``[setup]`` into bind mounts for the agent's
sandbox:

1. the key (:func:`~agentbox.env._key.env_key`) is computed from the image id,
   the commands, the setup sandbox's variables, mounts and egress rules, the repo,
   the submitting user, and the fresh workspace's whole tree (or only its inputs,
   with ``[setup] key = "inputs"``);
2. **hit**: the frozen environment of that key is mounted copy-on-write
   (:class:`~agentbox.env._mount.EnvMount`); nothing runs, no proxy starts;
3. **miss**: the commands run in a sandbox of the same posture as the agent's
   (same backend, image, uid 64000, no capabilities, read-only root, only
   ``lo``), under ``[setup] deadline``, output to ``logs/setup.log``. With
   ``network = "registries"`` (or ``[network] allow``) a per-task egress proxy
   is its only way out: its socket is mounted at ``/run/agentbox/gw`` and relayed
   to ``127.0.0.1:3128`` inside, the host's CA bundle is mounted read-only and
   the proxy variables set; with ``network = "none"`` there is no socket at all.
   A failed setup (non-zero exit, deadline) is reported with its output tail and
   no agent starts. Then the directories setup created (whose parent existed
   before) are moved out of the workspace into a frozen environment, files it
   left elsewhere are removed, and the environment is mounted as for a hit.

So both ways the workspace the agent starts from (and collection reads) holds
the repo and empty mount points only: the diff and branch never carry
``node_modules``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agentbox.backends.base import (
    HOME_IN_SANDBOX,
    WORKSPACE_IN_SANDBOX,
    Backend,
    BindMount,
)
from agentbox.boxfile import Boxfile, DiskLimit, Setup
from agentbox.config import Settings
from agentbox.core.exitwords import kill_cause, oom_kills
from agentbox.core.log import get_logger
from agentbox.egress import EgressPolicy, summarize
from agentbox.env._brokered import brokered_rules, sandbox_config
from agentbox.env._egress import Egress, egress_argv, rule_secrets, start_egress
from agentbox.env._key import KeyScope, env_key, repo_identity
from agentbox.env._model import EnvInfo, SetupReport
from agentbox.env._mount import KEEP_DIR, EnvMount, make_mountpoint
from agentbox.env._store import EnvStore
from agentbox.env._tracked import MAX_NAMED, changes, fingerprint
from agentbox.errors import PathRefused
from agentbox.safepath import Kind, Tree, check_name, openat2
from agentbox.sandbox import spec_from_boxfile

log = get_logger(__name__)

#: The setup log is capped; the report carries its last characters.
MAX_SETUP_LOG = 16 << 20
TAIL_CHARS = 4000
#: A setup may create at most this many separate directories (``.venv``, ``a/node_modules`` …).
MAX_ROOTS = 32
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def setup_sandbox_name(task_id: str) -> str:
    """The sandbox a task's ``[setup]`` runs in (the orphan sweep keeps it while the
    task lives, as it keeps the agent's)."""
    return f"agentbox-setup-{task_id}"


def image_id(image: str) -> str:
    """The id of local image ``image`` the podman backend will run (the key must change
    when the image does): the backend's own per-process inspection, so it is exactly
    the image the sandboxes get, and costs nothing more to the task's start."""
    from agentbox.backends.oci._args import image_facts

    return image_facts(image).id


@dataclass
class EnvPlan:
    """What the agent's sandbox gets from ``[setup]``: mounts, and the report's part."""

    report: SetupReport
    mounts: tuple[BindMount, ...] = ()
    overlay: EnvMount | None = None
    info: EnvInfo | None = field(default=None)

    @property
    def failed(self) -> bool:
        return self.report.cache == "failed"

    def release(self) -> None:
        """Unmount the task's overlay; idempotent."""
        if self.overlay is not None:
            self.overlay.release()


def _env_mounts(
    backend: Backend,
    store: EnvStore,
    info: EnvInfo,
    task_root: Path,
    workspace: Path,
    uid: int,
    limit: DiskLimit,
) -> tuple[tuple[BindMount, ...], EnvMount | None]:
    """The sandbox's mounts of frozen environment ``info`` (and the host overlay, if any).

    A container gets bind mounts of a kernel overlay on the host (:class:`EnvMount`).
    A microVM gets each frozen directory as a *writable* mount, which its backend
    makes copy-on-write: a read-only disk of the frozen tree (cached) under an overlay
    in the guest, writes in a layer of the task's own, capped by its disk limit.
    """
    if backend.kind != "microvm":
        overlay = EnvMount(store.tree(info.key), task_root / "env")
        try:
            return overlay.mount(workspace, info.roots, uid, keep=info.keep, limit=limit), overlay
        except BaseException:
            overlay.release()
            raise
    tree = store.tree(info.key)
    mounts = [
        BindMount(tree / KEEP_DIR / rel, f"{HOME_IN_SANDBOX}/{rel}", read_only=False)
        for rel in info.keep
        if (tree / KEEP_DIR / rel).is_dir()
    ]
    for rel in info.roots:
        if rel == KEEP_DIR:
            continue
        if not make_mountpoint(workspace, rel, uid):
            log.warning("environment dir not mounted: a file is in its place", root=rel)
            continue
        mounts.append(BindMount(tree / rel, f"{WORKSPACE_IN_SANDBOX}/{rel}", read_only=False))
    return tuple(mounts), None


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - TAIL_CHARS * 4))
            data = fh.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]


def _snapshot(workspace: Path) -> set[bytes]:
    with Tree(workspace) as tree:
        return {e.path for e in tree.walk()}


def _parent(rel: bytes) -> bytes:
    return rel.rpartition(b"/")[0]


def _produced(workspace: Path, before: set[bytes]) -> tuple[list[bytes], list[bytes]]:
    """``(roots, loose)``: new directories whose parent existed, and other new entries there."""
    roots: list[bytes] = []
    loose: list[bytes] = []
    with Tree(workspace) as tree:
        for e in tree.walk(prune=lambda rel: any(rel.startswith(r + b"/") for r in roots)):
            if e.path in before:
                continue
            parent = _parent(e.path)
            if parent and parent not in before:
                continue
            (roots if e.kind is Kind.DIR else loose).append(e.path)
    return roots, loose


def _unlink_beneath(workspace: Path, rel: bytes) -> None:
    parts = check_name(rel)
    root = os.open(workspace, _DIR)
    try:
        parent = openat2(root, b"/".join(parts[:-1]), _DIR) if len(parts) > 1 else root
        try:
            os.unlink(parts[-1], dir_fd=parent)
        finally:
            if parent != root:
                os.close(parent)
    finally:
        os.close(root)


def _move_out(workspace: Path, rel: bytes, dest: Path) -> None:
    """Move directory ``rel`` (beneath ``workspace``, no link followed) to ``dest``."""
    parts = check_name(rel)
    dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    root = os.open(workspace, _DIR)
    try:
        parent = openat2(root, b"/".join(parts[:-1]), _DIR) if len(parts) > 1 else root
        try:
            os.rename(parts[-1], dest, src_dir_fd=parent)
        finally:
            if parent != root:
                os.close(parent)
    finally:
        os.close(root)


def _sink(fh: object, limit: int) -> Callable[[bytes], None]:
    written = 0

    def write(chunk: bytes) -> None:
        nonlocal written
        if written >= limit:
            return
        room = limit - written
        fh.write(chunk[:room])  # type: ignore[attr-defined]
        written += min(len(chunk), room)
        if written >= limit:
            fh.write(b"\n[agentbox: setup output past this point dropped]\n")  # type: ignore[attr-defined]
        fh.flush()  # type: ignore[attr-defined]

    return write


def keep_paths(setup: Setup) -> list[str]:
    """``[setup] keep`` as paths relative to ``$HOME`` (``.cache/ms-playwright``)."""
    return [str(PurePosixPath(k[2:])) for k in setup.keep]


def _script(setup: Setup) -> str:
    lines = ["set -e", "cd /workspace"]
    for cmd in setup.run:
        lines.append(f"printf '+ %s\\n' {_sh_quote(cmd)} >&2")
        lines.append(cmd)
    # What [setup] keep names is carried out of $HOME (a tmpfs gone with the sandbox)
    # into /workspace/.agentbox-keep, from where it is frozen like the rest.
    for rel in keep_paths(setup):
        src, dst = _sh_quote(f"{HOME_IN_SANDBOX}/{rel}"), _sh_quote(f"/workspace/{KEEP_DIR}/{rel}")
        lines.append(f'if [ -e {src} ]; then mkdir -p "$(dirname {dst})" && cp -a {src} {dst}; fi')
    return "\n".join(lines) + "\n"


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _shown(info: EnvInfo) -> list[str]:
    """The environment's directories as the report names them (``keep`` ones as ``~/…``)."""
    return [r for r in info.roots if r != KEEP_DIR] + [f"~/{k}" for k in info.keep]


#: After a cancel the setup's sandbox is killed, and killed again this often until its
#: run ends: a kill before its container exists finds nothing (as the launcher's monitor).
KILL_AGAIN_EVERY = 2.0


def _watch(
    cancelled: Callable[[], bool], done: threading.Event, kill: Callable[[], object]
) -> None:
    while not done.wait(0.5):
        if cancelled():
            break
    else:
        return
    while True:
        with contextlib.suppress(Exception):
            kill()
        if done.wait(KILL_AGAIN_EVERY):
            return


def _key_hosts(policy: EgressPolicy) -> list[str]:
    """What of the egress policy keys the environment: the allowed hosts and the rules
    (never a secret's value: a rule names its secrets)."""
    out = [r.model_dump_json() for r in policy.rules]
    out += [json.dumps(r, sort_keys=True) for r in policy.request_rules]
    return out


def prepare_env(
    settings: Settings,
    box: Boxfile,
    backend: Backend,
    *,
    task_id: str,
    task_root: Path,
    workspace: Path,
    log_dir: Path,
    labels: Mapping[str, str],
    proxy_identity: tuple[int, int] | None,
    cancelled: Callable[[], bool] = lambda: False,
    tlog: Callable[[str], None] = lambda msg: None,
    user: int | None = None,
    repo: Path | None = None,
    resumed: bool = False,
) -> EnvPlan:
    """Make ``box.setup``'s environment available to the task (see the module docstring).

    Returns a plan whose ``report.cache`` is ``hit``, ``miss`` or ``failed``; call
    :meth:`EnvPlan.release` after the agent's sandbox is gone. Raises
    :class:`~agentbox.errors.AgentboxError` subclasses for what is not the setup's
    own failure (a refused input, a proxy that does not start).

    ``user`` (the submitting uid), ``repo`` (the task's repo) and ``resumed`` (the
    workspace is a previous task's result) are part of the key (:mod:`._key`); the user
    only unless the host shares environments across users.
    """
    setup = box.setup
    if setup is None:
        raise ValueError("prepare_env needs a Boxfile with [setup]")
    spec0 = spec_from_boxfile(box, settings, name=f"agentbox-setup-{task_id}")
    img = image_id(spec0.image)
    policy = None
    # The host user's registry credentials: rules for the proxy, never the sandbox.
    brokered, rules = brokered_rules(settings, box, phase="setup", uid=user, repo=repo)
    if setup.network == "registries" or box.egress_allow or rules:
        policy = EgressPolicy.for_phase(
            settings,
            allow=box.egress_allow,
            registries=setup.network == "registries",
            rules=rules,
            phase="setup",
        )
    owner = None if settings.env_shared_across_users else user
    scope = KeyScope(
        user=owner,
        repo=repo_identity(repo) if repo is not None else "",
        env=spec0.env,
        mounts=[(str(m.source), m.target, m.read_only) for m in spec0.mounts],
        hosts=[] if policy is None else _key_hosts(policy),
        resumed=resumed,
    )
    key, inputs = env_key(img, setup, workspace, scope)
    store = EnvStore(settings)
    uid = settings.sandbox_host_uid
    # The agent's writes into the environment count against the task's disk limit.
    limit = spec0.resources.disk_limit(settings)
    info = store.get(key)
    if info is not None:
        tlog(f"environment {key[:12]} is frozen: setup skipped (cache hit)")
        mounts, overlay = _env_mounts(backend, store, info, task_root, workspace, uid, limit)
        store.touch(key)
        report = SetupReport(
            cache="hit", key=key, ran=False, roots=_shown(info), files=info.files, size=info.size
        )
        return EnvPlan(report=report, mounts=mounts, overlay=overlay, info=info)

    tlog(f"running setup ({len(setup.run)} command(s), deadline {setup.deadline:g}s)")
    before = _snapshot(workspace)
    tracked = fingerprint(workspace)
    if setup.keep and os.fsencode(KEEP_DIR) in before:
        raise PathRefused(f"the repo has a {KEEP_DIR} of its own: [setup] keep cannot be used")
    egress: Egress | None = None
    net_dir = task_root / "setup-net"
    egress_log = log_dir / "egress-setup.jsonl"
    env: dict[str, str] = {}
    extra_mounts: tuple[BindMount, ...] = ()
    argv = ["/bin/sh", "-c", _script(setup)]
    if policy is not None:
        net_dir.mkdir(mode=0o755)
        values = rule_secrets(settings, policy.network_rules, user, known=brokered.values)
        egress = start_egress(
            settings, policy, net_dir, egress_log, proxy_identity, secret_values=values
        )
        env = {**egress.env, **sandbox_config(settings, egress, brokered)}
        for note in brokered.notes:
            tlog(note)
        extra_mounts = (egress.mount,)
        argv = egress_argv(argv)
        tlog(f"setup egress through the proxy: {', '.join(policy.hosts) or 'no hosts'}")
    started = time.time()
    done = threading.Event()
    name = setup_sandbox_name(task_id)
    oom_before = oom_kills()
    try:
        spec = spec_from_boxfile(
            box,
            settings,
            name=name,
            workspace=workspace,
            gateway_dir=net_dir if egress is not None else None,
            extra_env=env,
            labels=labels,
        )
        spec = spec.replace(deadline=setup.deadline, mounts=(*spec.mounts, *extra_mounts))
        watcher = threading.Thread(
            target=_watch, args=(cancelled, done, lambda: backend.kill(name)), daemon=True
        )
        watcher.start()
        with (log_dir / "setup.log").open("ab") as out:
            sink = _sink(out, MAX_SETUP_LOG)
            res = backend.run(spec, argv, on_stdout=sink, on_stderr=sink)
    finally:
        done.set()
        if egress is not None:
            egress.proxy.stop(grace=2.0)
    duration = round(time.time() - started, 3)
    summary = summarize(egress_log).model_dump(mode="json") if egress is not None else None
    tail = _tail(log_dir / "setup.log")
    report = SetupReport(
        cache="failed",
        key=key,
        ran=True,
        exit_code=res.exit_code,
        timed_out=res.timed_out,
        duration_s=duration,
        output_tail=tail,
        egress=summary,
    )
    if res.exit_code is not None and res.exit_code > 128:
        report.killed = kill_cause(
            timed_out=res.timed_out, cancelled=cancelled(), oom_before=oom_before,
            oom_after=oom_kills(),
        )  # fmt: skip
    if res.exit_code != 0 or res.timed_out or cancelled():
        tlog(f"setup failed ({report.exit_words}{', deadline' if res.timed_out else ''})")
        return EnvPlan(report=report)
    changed = changes(workspace, tracked)
    if changed:
        # Decided in env/_tracked.py: a setup that edits the repo's files fails the task.
        report.tracked_changed = changed[:MAX_NAMED]
        shown = ", ".join(changed[:5]) + (
            f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        )
        report.output_tail = (
            tail + f"\n[agentbox] setup changed {len(changed)} file(s) of the repo "
            f"(a setup may only add files): {shown}\n"
        )[-TAIL_CHARS:]
        tlog(f"setup changed files of the repo: {shown}")
        return EnvPlan(report=report)
    tlog(f"setup done in {duration:.1f}s; freezing what it made")
    roots, loose = _produced(workspace, before)
    if len(roots) > MAX_ROOTS:
        report.output_tail = (
            f"[agentbox] setup created {len(roots)} separate directories "
            f"(at most {MAX_ROOTS})\n" + tail
        )
        return EnvPlan(report=report)
    for rel in loose:
        with contextlib.suppress(OSError, PathRefused):
            _unlink_beneath(workspace, rel)
    stage = store.staging()
    try:
        for rel in roots:
            _move_out(workspace, rel, stage / "tree" / os.fsdecode(rel))
        info = store.freeze(
            stage,
            EnvInfo(
                key=key,
                image=spec0.image,
                commands=list(setup.run),
                inputs=inputs,
                user=owner,
                repo=scope.repo,
                roots=[os.fsdecode(r) for r in roots],
                keep=[k for k in keep_paths(setup) if (stage / "tree" / KEEP_DIR / k).exists()],
            ),
        )
    except BaseException:
        store.discard(stage)
        raise
    mounts, overlay = _env_mounts(backend, store, info, task_root, workspace, uid, limit)
    store.touch(key)
    report.cache = "miss"
    report.roots, report.files, report.size = _shown(info), info.files, info.size
    report.dropped = [os.fsdecode(r) for r in loose[:50]]
    return EnvPlan(report=report, mounts=mounts, overlay=overlay, info=info)
