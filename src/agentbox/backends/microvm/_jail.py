"""The VMM's jail: bubblewrap namespaces, an empty capability set, a uid, cgroup limits.

QEMU runs as::

    bwrap --unshare-{ipc,pid,net,uts,cgroup-try} --die-with-parent --new-session
          --cap-drop ALL  --ro-bind /usr …  --ro-bind <kernel, initramfs, root disk>
          --bind <data disk> --bind <socket dir>  --dev /dev  --proc /proc
      setpriv --reuid U --regid U --clear-groups --no-new-privs
              --inh-caps -all --bounding-set -all
        qemu-system-x86_64 … -sandbox on,obsolete=deny,elevateprivileges=deny,
                                      spawn=deny,resourcecontrol=deny

so the VMM sees only ``/usr`` (its own binary and libraries), the files the
sandbox declares, and its socket directory; it has its own mount, pid, ipc,
uts and network namespaces (the guest has no NIC anyway), no capabilities, no
way to gain any, and QEMU's seccomp filter on every thread. It is put into
pids and memory cgroups (v1 hierarchies or v2) before it execs, by the
pre-exec hook of the process that spawns it.

All VMMs are spawned by one long-lived thread: ``PR_SET_PDEATHSIG`` fires
when the *thread* that forked the child exits, so a VMM spawned by a
short-lived worker thread would die with it. With the dedicated thread a VMM
dies exactly when the host process dies (bwrap's ``--die-with-parent`` then
takes QEMU down with it).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import SandboxError, UnsupportedError
from agentbox.linux.libc import libc

log = get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Threads QEMU may have (vCPUs, I/O workers, RCU, …); a guest cannot fork on the host.
VMM_PIDS_MAX = 128


@dataclass(frozen=True)
class JailSpec:
    """What goes into one VMM's jail: binds (host path → path in jail) and the identity."""

    ro_binds: tuple[tuple[Path, str], ...]
    rw_binds: tuple[tuple[Path, str], ...]
    uid: int
    gid: int
    dev_binds: tuple[str, ...] = ()
    extra: tuple[str, ...] = field(default=())


def jail_argv(spec: JailSpec, inner: Sequence[str]) -> list[str]:
    """The bwrap + setpriv argv that runs ``inner`` inside the jail."""
    argv = [
        "bwrap",
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent", "--new-session",
        "--hostname", "agentbox-vmm",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
        "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--dir", "/vm",
    ]  # fmt: skip
    for src, dst in spec.ro_binds:
        argv += ["--ro-bind", str(src), dst]
    for src, dst in spec.rw_binds:
        argv += ["--bind", str(src), dst]
    for dev in spec.dev_binds:
        argv += ["--dev-bind", dev, dev]
    argv += ["--chdir", "/vm", *spec.extra]
    argv += [
        "setpriv", f"--reuid={spec.uid}", f"--regid={spec.gid}", "--clear-groups",
        "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--",
    ]  # fmt: skip
    return argv + list(inner)


class Cgroup:
    """A pids + memory cgroup for one VMM (v1 hierarchies here; v2 where unified)."""

    def __init__(self, name: str, *, pids_max: int, memory_bytes: int) -> None:
        self.name = name
        self.dirs: list[Path] = []
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            base = CGROUP_ROOT / "agentbox"
            self._mk(base, {"cgroup.subtree_control": "+pids +memory"}, parent=True)
            self._mk(base / name, {"pids.max": str(pids_max), "memory.max": str(memory_bytes),
                                   "memory.swap.max": "0"})  # fmt: skip
        else:
            pids = CGROUP_ROOT / "pids" / "agentbox"
            mem = CGROUP_ROOT / "memory" / "agentbox"
            self._mk(pids, {}, parent=True)
            self._mk(mem, {}, parent=True)
            self._mk(pids / name, {"pids.max": str(pids_max)})
            self._mk(mem / name, {"memory.limit_in_bytes": str(memory_bytes),
                                  "memory.memsw.limit_in_bytes": str(memory_bytes)})  # fmt: skip

    def _mk(self, d: Path, values: dict[str, str], *, parent: bool = False) -> None:
        try:
            d.mkdir(exist_ok=True)
        except OSError as exc:
            raise UnsupportedError(
                f"cannot create cgroup {d}: {exc}", fix="run agentbox's launcher as root"
            ) from exc
        if not parent:
            self.dirs.append(d)
        for key, value in values.items():
            p = d / key
            if key.startswith("memory.memsw") and not p.exists():
                continue  # swap accounting off: the memory limit alone holds
            try:
                p.write_text(value)
            except OSError as exc:
                if key == "cgroup.subtree_control":
                    continue
                raise SandboxError(f"cannot set {p} = {value}: {exc}") from exc

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files a child writes itself into before exec."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self) -> None:
        """Remove the cgroup dirs (kills what is left in them first); idempotent."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    pids = (d / "cgroup.procs").read_text().split()
                except OSError:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


_libc = libc()
_PR_SET_PDEATHSIG = 1


def _preexec(procs_files: list[str]) -> Callable[[], None]:
    encoded = [p.encode() for p in procs_files]

    def hook() -> None:
        # Runs in the child between fork and exec: no logging, no allocation-heavy work.
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for path in encoded:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    return hook


_Job = tuple[
    list[str], list[str], tuple[int, ...], "int | None", "int | None", "queue.Queue[object]"
]
_jobs: queue.Queue[_Job] = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _serve() -> None:
    while True:
        argv, procs, fds, stdout_fd, stderr_fd, reply = _jobs.get()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout_fd if stdout_fd is not None else subprocess.DEVNULL,
                stderr=stderr_fd if stderr_fd is not None else subprocess.DEVNULL,
                pass_fds=fds,
                start_new_session=True,
                preexec_fn=_preexec(procs),
            )
            reply.put(proc)
        except BaseException as exc:
            reply.put(exc)


def spawn(
    argv: Sequence[str],
    *,
    cgroup: Cgroup | None,
    pass_fds: tuple[int, ...] = (),
    stdout_fd: int | None = None,
    stderr_fd: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` from the long-lived spawner thread, inside ``cgroup``."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_serve, name="agentbox-vmm-spawner", daemon=True)
            _spawner.start()
    reply: queue.Queue[object] = queue.Queue()
    log.debug("spawn", argv=list(argv))
    _jobs.put(
        (list(argv), cgroup.procs_files if cgroup else [], pass_fds, stdout_fd, stderr_fd, reply)
    )
    got = reply.get()
    if isinstance(got, BaseException):
        raise SandboxError(f"cannot start the VMM: {got}") from got
    assert isinstance(got, subprocess.Popen)
    return got
