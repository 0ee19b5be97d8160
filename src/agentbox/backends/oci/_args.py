"""The podman command line of a hardened sandbox, and the checks made before it runs.

Each flag answers a line of the seed's "Agent container" list; the comment next
to it says which threat it closes. Nothing here starts a process except
:func:`image_facts` (``podman image inspect``, cached while podman's image list is
unchanged).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentbox.backends._seccomp import profile_path
from agentbox.backends.base import (
    GATEWAY_DIR_IN_SANDBOX,
    GATEWAY_PORT,
    GATEWAY_SOCKET_NAME,
    HOME_IN_SANDBOX,
    WORKSPACE_IN_SANDBOX,
    SandboxSpec,
)
from agentbox.backends.oci._userns_limits import SANDBOX_RLIMITS, hooks_dir
from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.core import host as _host
from agentbox.core import proc as _proc
from agentbox.errors import CommandError, ImageError, PathRefused, UnsupportedError
from agentbox.linux.acl import acl_allows

#: Where the image carries our relay shim (see agentbox/guest/relay.py).
RELAY_PATH = "/opt/agentbox/relay.py"
RUNTIMES = ("runc", "crun", "runsc")
#: conmon's own ``--timeout`` fires this long after our watchdog should have.
CONMON_GRACE = 5


@dataclass(frozen=True)
class ImageFacts:
    """What we need to know of an image before running it."""

    name: str
    id: str
    entrypoint: tuple[str, ...]

    @property
    def has_tini(self) -> bool:
        """The image's entrypoint is tini, so it already runs as PID 1."""
        return bool(self.entrypoint) and Path(self.entrypoint[0]).name.startswith("tini")


_facts_lock = threading.Lock()
#: image -> (its facts, the image store's signature when they were read, the pid that
#: read them): see :func:`store_signature`.
_facts: dict[str, tuple[ImageFacts, object, int]] = {}

#: podman's storage configuration as root's podman reads it: the first file found
#: (``CONTAINERS_STORAGE_CONF`` instead when set).
STORAGE_CONFS = ("/etc/containers/storage.conf", "/usr/share/containers/storage.conf")
DEFAULT_GRAPHROOT = "/var/lib/containers/storage"


def _stat_sig(path: Path) -> tuple[int, int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _image_list(confs: tuple[Path, ...]) -> Path | None:
    """podman's list of images (``<graphroot>/<driver>-images/images.json``), or None
    when it cannot be told for sure (additional image stores, several drivers' lists
    and none configured, a configuration not understood)."""
    import tomllib

    conf: dict[str, object] = {}
    for path in confs:
        if path.exists():
            try:
                conf = tomllib.loads(path.read_text())
            except (OSError, ValueError):
                return None
            break
    storage = conf.get("storage", {})
    if not isinstance(storage, dict):
        return None
    options = storage.get("options", {})
    if not isinstance(options, dict) or options.get("additionalimagestores"):
        return None
    root = storage.get("graphroot") or DEFAULT_GRAPHROOT
    driver = os.environ.get("STORAGE_DRIVER") or storage.get("driver")
    if not isinstance(root, str) or not isinstance(driver, str | None):
        return None
    if driver:
        path = Path(root) / f"{driver}-images" / "images.json"
        return path if path.is_file() else None
    try:
        lists = [d / "images.json" for d in Path(root).glob("*-images")]
    except OSError:
        return None
    lists = [p for p in lists if p.is_file()]
    return lists[0] if len(lists) == 1 else None


def store_signature() -> object:
    """What changes with every image podman builds, pulls, tags, untags or removes: its
    image list file's identity, size and times (and its configuration's), or None when
    unknown. Facts read under one signature hold while it is the same: a fork of a
    process that read them (the front end's commands) uses them without a ``podman
    image inspect`` of its own, and a rebuilt or removed image is inspected again."""
    if os.geteuid() != 0:  # a rootless podman keeps its images elsewhere
        return None
    env_conf = os.environ.get("CONTAINERS_STORAGE_CONF")
    confs = tuple(Path(c) for c in ((env_conf,) if env_conf else STORAGE_CONFS))
    conf_sigs = tuple(_stat_sig(c) for c in confs)
    path = _image_list(confs)
    if path is None:
        return None
    sig = _stat_sig(path)
    return None if sig is None else (confs, conf_sigs, path, sig)


#: One lookup of an image at a time: a launch waits for a warm-up's (Backend.warm)
#: rather than starting a second ``podman image inspect`` beside it.
_lookups: dict[str, threading.Lock] = {}


def _cached(image: str) -> ImageFacts | None:
    """``image``'s facts if still true: read under the image store's signature of now,
    or (no signature known) by this very process, as before."""
    with _facts_lock:
        got = _facts.get(image)
    if got is None:
        return None
    facts, sig, pid = got
    if sig is None:
        return facts if pid == os.getpid() else None
    return facts if sig == store_signature() else None


def image_facts(image: str, *, refresh: bool = False) -> ImageFacts:
    """Inspect ``image`` in podman's local storage (cached while the image store's
    signature is the same, :func:`store_signature`).

    Raises :class:`ImageError` with the fix when it is not there: sandboxes
    never pull from a registry.
    """
    if not refresh and (facts := _cached(image)) is not None:
        return facts
    with _facts_lock:
        lookup = _lookups.setdefault(image, threading.Lock())
    with lookup:
        if not refresh and (facts := _cached(image)) is not None:  # by the one we waited on
            return facts
        return _inspect_image(image)


def _inspect_image(
    image: str, *, run: Callable[[list[str]], _proc.Result] | None = None
) -> ImageFacts:
    sig = store_signature()  # before the inspect: a change during it shows next time
    argv = ["podman", "image", "inspect", "--format", "{{.Id}} {{json .Config.Entrypoint}}"]
    try:
        res = _proc.run([*argv, image], timeout=60) if run is None else run([*argv, image])
    except CommandError as exc:
        fix = (
            "run `agentbox image build`"
            if image.partition(":")[0] == DEFAULT_IMAGE.partition(":")[0]
            else "build or load it locally (agentbox never pulls)"
        )
        raise ImageError(f"image {image} is not in podman's local storage; {fix}") from exc
    image_id, _, ep_json = res.stdout.strip().partition(" ")
    try:
        ep = json.loads(ep_json) if ep_json else None
    except json.JSONDecodeError:
        ep = None
    entrypoint = tuple(str(x) for x in ep) if isinstance(ep, list) else ()
    facts = ImageFacts(image, image_id, entrypoint)
    with _facts_lock:
        _facts[image] = (facts, sig, os.getpid())
    return facts


def warm_image_facts(image: str) -> None:
    """Read ``image``'s facts ahead for the processes this one forks (the front end's
    server, which logs nothing: no :mod:`agentbox.core.proc`), if not already true;
    one that is not there is left for its command to say so."""
    import subprocess

    def run(argv: list[str]) -> _proc.Result:
        res = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=60,
            stdin=subprocess.DEVNULL, start_new_session=True, check=False,
        )  # fmt: skip
        if res.returncode != 0:
            raise CommandError(tuple(argv), res.returncode, res.stderr, res.stdout)
        return _proc.Result(tuple(argv), res.returncode, res.stdout, res.stderr)

    if _cached(image) is not None:
        return
    sig = store_signature()
    if sig is not None and _not_there.get(image) == sig:
        return  # not there, and podman's image list unchanged since: asked again later
    try:
        _inspect_image(image, run=run)
    except (ImageError, OSError, subprocess.SubprocessError):
        _not_there[image] = sig


#: Images :func:`warm_image_facts` found missing, with the image store's signature then.
_not_there: dict[str, object] = {}


def forget_image(image: str) -> None:
    """Drop ``image`` from the per-process cache (after it was found missing)."""
    with _facts_lock:
        _facts.pop(image, None)


def _check_dir(path: Path, what: str) -> None:
    if not path.is_absolute():
        raise PathRefused(f"{what} must be absolute", path=path)
    if not path.is_dir():
        raise PathRefused(f"{what} does not exist or is not a directory", path=path)
    if any(c in str(path) for c in (",", ":", "\n", "\0")):
        raise PathRefused(f"{what} contains ',', ':' or a newline", path=path)


def check_spec(
    spec: SandboxSpec, *, subid_base: int = 100000, with_image: bool = True
) -> ImageFacts | None:
    """Refuse ``spec`` if podman cannot honour it here; nothing is started.

    Checks the runtime (known, installed, usable on this host's cgroups), the
    mounts (absolute, existing, no characters podman's syntax would split on),
    the uid (inside the 65536-id map) and, with ``with_image``, the image.
    """
    if spec.runtime not in RUNTIMES:
        raise UnsupportedError(
            f"unknown OCI runtime {spec.runtime!r}", fix=f"use one of {', '.join(RUNTIMES)}"
        )
    fac = _host.podman_runtime(spec.runtime)
    if not fac.ok:
        raise UnsupportedError(f"runtime {spec.runtime} unusable here: {fac.detail}", fix=fac.fix)
    if not 0 < spec.uid < 65536:
        raise UnsupportedError(f"sandbox uid {spec.uid} is outside the 65536-id map")
    if spec.workspace is not None:
        _check_dir(spec.workspace, "workspace")
    if spec.gateway_dir is not None:
        _check_dir(spec.gateway_dir, "gateway dir")
    for m in spec.mounts:
        if not m.source.is_absolute() or not m.source.exists():
            raise PathRefused("declared mount is not an existing absolute path", path=m.source)
        if any(c in str(m.source) + m.target for c in (",", ":", "\n", "\0")):
            raise PathRefused("declared mount contains ',', ':' or a newline", path=m.source)
    if spec.runtime == "runsc":
        # gVisor's gofer opens bind-mount sources as the mapped container root
        # (subid_base), not as root: every ancestor must be searchable by it.
        sources = [m.source for m in spec.mounts]
        sources += [p for p in (spec.workspace, spec.gateway_dir) if p is not None]
        for src in sources:
            blocked = _searchable_by(src, subid_base)
            if blocked is not None:
                raise PathRefused(
                    f"runsc's gofer (host uid {subid_base}) cannot reach {src} "
                    f"(fix: chmod o+x {blocked})",
                    path=blocked,
                )
    return image_facts(spec.image) if with_image else None


def podman_global_args(runtime: str, *, gateway: bool = False) -> list[str]:
    """``podman --runtime …``: gVisor additionally gets its network switched off at runsc level."""
    args = ["podman", "--runtime", runtime]
    if runtime == "runsc":
        # network=none inside gVisor itself (not only an empty netns), and apply the
        # OCI seccomp profile to the workload inside the sentry as well.
        args += ["--runtime-flag", "network=none", "--runtime-flag", "oci-seccomp"]
        if gateway:
            # gVisor refuses host unix sockets by default; "open" lets the relay connect
            # to the (existing) gateway socket, and never create one on the host.
            args += ["--runtime-flag", "host-uds=open"]
    return args


def _searchable_by(path: Path, uid: int) -> Path | None:
    """The first ancestor of ``path`` that runsc's gofer (host ``uid``) cannot traverse.

    The gofer is root of the container's user namespace (host ids ``uid`` ..
    ``uid+65535``) with CAP_DAC_OVERRIDE there: a directory whose owner and
    group are both mapped is always traversable; any other needs its x bit, or a
    named-user ACL entry giving ``uid`` search (what the launcher sets on its task dirs).
    """
    mapped = range(uid, uid + 65536)
    for d in [*reversed(path.parents), path]:
        try:
            st = d.stat()
        except OSError:
            return d
        if st.st_uid in mapped and st.st_gid in mapped:
            continue
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == uid else 0o001
        if not st.st_mode & bit and not acl_allows(d, uid, 1):
            return d
    return None


def _mount_opts(read_only: bool, *, noexec: bool = False) -> str:
    opts = ["ro" if read_only else "rw", "nosuid", "nodev"]
    if noexec:
        opts.append("noexec")
    return ",".join(opts)


def run_args(
    spec: SandboxSpec,
    settings: Settings,
    facts: ImageFacts,
    *,
    detach: bool,
    env_file: Path,
    interactive: bool = False,
    tty: bool = False,
    log: Path | None = None,
    log_max: int = 0,
    unsafe_extra_args: Sequence[str] = (),
) -> list[str]:
    """The full ``podman … run …`` argv up to and including the image name.

    With ``detach`` and ``log`` (a detached sandbox, ``PodmanBackend.launch``),
    conmon writes the output to ``log`` in the ``k8s-file`` format, at most
    ``log_max`` bytes (it then truncates and starts over: see _k8slog.py).
    """
    res = spec.resources
    uid = spec.uid
    base = settings.sandbox_subid_base
    mem = str(res.memory)
    timeout = math.ceil(spec.deadline) + CONMON_GRACE
    args = [*podman_global_args(spec.runtime, gateway=spec.gateway_dir is not None)]
    # A prestart hook caps the per-user kernel counters of the sandbox's user namespace,
    # which the kernel also charges to root (see _userns_limits.py).
    args += ["--hooks-dir", str(hooks_dir(settings.cache_dir)), "run"]
    args += ["-d"] if detach else ["--rm", "--log-driver", "passthrough"]
    if detach and log is not None:
        if not log.is_absolute() or any(c in str(log) for c in (",", "\n", "\0")):
            # --log-opt splits on ",": a comma would smuggle in another option.
            raise PathRefused(
                "the sandbox log must be absolute, without ',' or a newline", path=log
            )
        args += ["--log-driver", "k8s-file", "--log-opt", f"path={log}"]
        if log_max > 0:
            args += ["--log-opt", f"max-size={log_max}"]
    if interactive:
        args.append("-i")
    if tty:
        args.append("-t")
    args += [
        "--name", spec.name,
        "--pull", "never",                  # never reach a registry
        "--network", "none",                # only lo
        "--no-hosts",                       # no /etc/hosts naming host addresses
        "--read-only",                      # read-only root filesystem
        "--read-only-tmpfs=false",          # no implicit tmpfs on /run, /var/tmp: only ours
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        # podman's default seccomp profile minus user-namespace creation (see _seccomp.py).
        "--security-opt",
        f"seccomp={profile_path(settings.cache_dir, allow_clone3=spec.runtime == 'runsc')}",
        "--ipc", "private",
        "--cgroupns", "private",            # its own cgroup tree, not the host's (v1 default)
        # uid/gid N inside is base+N outside: a host range of this sandbox's own (_uidslots).
        "--uidmap", f"0:{base}:65536",
        "--gidmap", f"0:{base}:65536",
        "--user", f"{uid}:{uid}",
        "--pids-limit", str(res.pids),
        "--memory", mem,
        "--memory-swap", mem,               # equal to memory: no swap
        "--cpus", f"{res.cpus:g}",
        # Always explicit: the host's hard nofile limit (20000) cannot be raised from a userns.
        "--ulimit", f"nofile={res.nofile}:{res.nofile}",
        "--ulimit", f"nproc={res.pids}:{res.pids}",
        # Charged to root's quota too: bounded per sandbox (see _userns_limits.py).
        *(a for k, v in sorted(SANDBOX_RLIMITS.items()) for a in ("--ulimit", f"{k}={v}:{v}")),
        "--tmpfs", "/tmp:rw,nosuid,nodev,mode=1777",
        "--tmpfs", f"{HOME_IN_SANDBOX}:rw,nosuid,nodev,mode=1777",
        "--workdir", spec.workdir,
        "--env-file", str(env_file),
        "--timeout", str(timeout),          # conmon kills it even if agentbox died
        "--stop-timeout", "5",
    ]  # fmt: skip
    if spec.workspace is not None:
        args += ["-v", f"{spec.workspace}:{WORKSPACE_IN_SANDBOX}:{_mount_opts(False)}"]
    if spec.gateway_dir is not None:
        gw_opts = _mount_opts(False, noexec=True)
        args += ["-v", f"{spec.gateway_dir}:{GATEWAY_DIR_IN_SANDBOX}:{gw_opts}"]
    for m in spec.mounts:
        args += ["-v", f"{m.source}:{m.target}:{_mount_opts(m.read_only)}"]
    for key, value in sorted(spec.labels.items()):
        args += ["--label", f"{key}={value}"]
    args += ["--label", f"io.agentbox.owner-pid={os.getpid()}"]
    args += ["--label", f"io.agentbox.runtime={spec.runtime}"]
    if not facts.has_tini:
        # tini is not the image's entrypoint: clear it and let podman put its init first.
        args += ["--entrypoint", "", "--init"]
    args += list(unsafe_extra_args)
    args.append(facts.id if facts.id else spec.image)
    return args


#: Starts the relay's C twin (``guest/relay.c``, same options) where the image has it,
#: else ``relay.py``: a Python interpreter's start cost every task 0.05-0.17 s before
#: its command ran (measured in a sandbox, 2-core host); ``sh`` costs ~1 ms.
_RELAY_ENTRY = 'r=${0%.py}; [ -x "$r" ] || exec python3 -I -S "$0" "$@"; exec "$r" "$@"'


def entry_argv(spec: SandboxSpec, argv: Sequence[str]) -> list[str]:
    """The container's command: ``argv``, behind the gateway relay when there is a gateway."""
    if spec.gateway_dir is None:
        return list(argv)
    return [
        "/bin/sh", "-c", _RELAY_ENTRY, RELAY_PATH,
        "--port", str(GATEWAY_PORT),
        "--socket", f"{GATEWAY_DIR_IN_SANDBOX}/{GATEWAY_SOCKET_NAME}",
        "--", *argv,
    ]  # fmt: skip
