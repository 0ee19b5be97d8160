"""What a task's sandbox used: CPU seconds, peak memory, disk written and its peak,
processes, egress bytes (docs/reference/report.md).

A container's cgroup disappears with the container, so the figures are *sampled* while
it runs (:class:`Sampler`, a thread of the launcher that follows the sandbox) and the
maxima kept; ``<task dir>/resources.json`` is rewritten every :data:`WRITE_EVERY`
seconds (``agentbox tasks --json`` and ``show`` read it while the task runs) and once
more when the sandbox has ended. Where each figure comes from:

- ``cpu_s``: the container's cgroup, cgroup v1 ``cpuacct.usage`` (ns) or v2
  ``cpu.stat`` ``usage_usec``; the last sample (at most :data:`SAMPLE_EVERY` seconds
  before the end: the cgroup is removed with the container);
- ``memory_peak_bytes``: v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak`` (the
  kernel's own maximum, page cache of the sandbox's writes included);
  ``memory_anon_peak_bytes``: the largest sampled anonymous memory (v1 ``memory.stat``
  ``total_rss``, v2 ``anon``);
- ``disk_written_bytes``: what the sandbox's processes wrote to storage (the sum of
  ``write_bytes`` of ``/proc/<pid>/io`` over the cgroup's processes: each one's figure
  holds its reaped children's, so the container's init holds the dead ones'), sampled;
  ``disk_device_written_bytes``: sectors written to the workspace's loop device
  (``/sys/block/loopN/stat``, field 7, times 512) since the first sample, read once more
  after the disk's unmount (which flushes what writeback had held back): the
  filesystem's own writes included (journal, ext4's lazy inode-table init);
  ``disk_peak_bytes``: the largest sampled used size of the workspace filesystem
  (``statvfs``; the repo copy included);
- ``processes_peak``: the most processes seen at once in the cgroup (``cgroup.procs``,
  sampled): cgroups keep no fork counter, so **processes started** is not known;
  ``tasks_peak``: the kernel's ``pids.peak`` (threads included) where it has one, else
  the largest sampled ``pids.current``;
- ``egress_bytes``: up plus down of the agent's and setup's egress proxies (from the
  report's ``egress`` and ``setup.egress`` summaries), at the end only.

Every host file here is read defensively (a size cap, no link followed where a path
could be the sandbox's, unparsable text → no figure): the sandbox's processes choose
what these counters say, never what is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentbox.core.log import get_logger

log = get_logger(__name__)

RESOURCES_FILE = "resources.json"
#: Seconds between two samples of the cgroup files, and between two writes of the file.
SAMPLE_EVERY = 1.0
WRITE_EVERY = 2.0
#: Seconds between two tries to find the sandbox's init process (the engine's inspect).
FIND_EVERY = 2.0
#: Finds made a second apart before backing off (a sandbox's start under load).
EAGER_FINDS = 20
_MAX_READ = 64 << 10
_SECTOR = 512
#: A container id's characters (a claim record's ``id``).
HEX = frozenset("0123456789abcdef")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


# -- pure parsers (fixture-tested) -----------------------------------------------------


def parse_int(text: str) -> int | None:
    """A counter file's one non-negative integer (``max`` or junk: None)."""
    word = text.strip()
    if not word.isdigit() or len(word) > 30:
        return None
    return int(word)


def parse_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (``cpu.stat``, ``memory.stat``); bad lines skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines()[:500]:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and len(parts[1]) <= 30:
            out.setdefault(parts[0], int(parts[1]))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as controller → path: each v1 controller of a line
    (``4:cpu,cpuacct:/x`` gives ``cpu`` and ``cpuacct``), ``0`` for the unified one."""
    out: dict[str, str] = {}
    for line in text.splitlines()[:64]:
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        num, ctrls, path = parts
        if num == "0" and ctrls == "":
            out["0"] = path
            continue
        for ctrl in ctrls.split(","):
            if ctrl:
                out.setdefault(ctrl, path)
    return out


def parse_status_kb(text: str, key: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmHWM:   123 kB``) in bytes."""
    for line in text.splitlines()[:200]:
        name, sep, rest = line.partition(":")
        if sep and name == key:
            words = rest.split()
            if len(words) == 2 and words[1] == "kB" and words[0].isdigit():
                return int(words[0]) * 1024
            return None
    return None


def parse_io_written(text: str) -> int | None:
    """``/proc/<pid>/io``: ``write_bytes`` (bytes it sent, or will send, to storage:
    counted when a page is dirtied, its reaped children's included)."""
    return parse_keyed(text.replace(":", " ")).get("write_bytes")


#: The most processes whose ``io`` one sample reads (a fork bomb costs no more).
MAX_IO_READS = 512


def written_by(pids: set[int]) -> int:
    """What the live processes ``pids`` wrote to storage (each one's own and its reaped
    descendants': a process's figure holds its waited-for children's)."""
    total = 0
    for pid in sorted(pids)[:MAX_IO_READS]:
        got = parse_io_written(_read(Path(f"/proc/{pid}/io")) or "")
        total += got or 0
    return total


def parse_sectors_written(text: str) -> int | None:
    """``/sys/block/<dev>/stat``: field 7 (sectors written)."""
    fields = text.split()
    if len(fields) < 7 or not fields[6].isdigit():
        return None
    return int(fields[6])


def mount_source(mountinfo: str, mount_point: str) -> str | None:
    """The source of the last mount at ``mount_point`` (the one on top) in mountinfo text."""
    found = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        if _unescape(fields[4]) == mount_point:
            found = tail[1]
    return found


def _unescape(path: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, _MAX_READ).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


# -- the cgroup of one sandbox ------------------------------------------------------------


@dataclass
class Cgroup:
    """The directories of one process's cgroups (v1: per controller; v2: one)."""

    cpu: Path | None = None
    memory: Path | None = None
    pids: Path | None = None
    v2: bool = False

    @classmethod
    def of_pid(cls, pid: int, root: Path = _CGROUP_ROOT) -> Cgroup | None:
        text = _read(Path(f"/proc/{pid}/cgroup"))
        return None if text is None else cls.from_paths(parse_proc_cgroup(text), root)

    @classmethod
    def from_paths(cls, paths: Mapping[str, str], root: Path = _CGROUP_ROOT) -> Cgroup | None:
        def under(base: Path, rel: str) -> Path | None:
            if ".." in rel.split("/"):
                return None
            return base / rel.lstrip("/")

        if "cpuacct" in paths or "memory" in paths:  # v1 (hybrid or not)
            cg = cls(
                cpu=under(root / "cpuacct", paths["cpuacct"]) if "cpuacct" in paths else None,
                memory=under(root / "memory", paths["memory"]) if "memory" in paths else None,
                pids=under(root / "pids", paths["pids"]) if "pids" in paths else None,
            )
            return cg if cg.cpu or cg.memory or cg.pids else None
        if "0" in paths:
            base = under(root, paths["0"])
            if base is None or not (base / "cgroup.controllers").exists():
                base = under(root / "unified", paths["0"])
            return cls(cpu=base, memory=base, pids=base, v2=True) if base is not None else None
        return None

    def cpu_ns(self) -> int | None:
        if self.cpu is None:
            return None
        if self.v2:
            usec = parse_keyed(_read(self.cpu / "cpu.stat") or "").get("usage_usec")
            return None if usec is None else usec * 1000
        return parse_int(_read(self.cpu / "cpuacct.usage") or "")

    def memory_peak(self) -> int | None:
        if self.memory is None:
            return None
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return parse_int(_read(self.memory / name) or "")

    def memory_anon(self) -> int | None:
        if self.memory is None:
            return None
        stat = parse_keyed(_read(self.memory / "memory.stat") or "")
        return stat.get("anon" if self.v2 else "total_rss")

    def processes(self) -> set[int] | None:
        if self.pids is None:
            return None
        text = _read(self.pids / "cgroup.procs")
        if text is None:
            return None
        return {int(w) for w in text.split()[:100_000] if w.isdigit() and len(w) < 12}

    def tasks_peak(self) -> int | None:
        if self.pids is None:
            return None
        peak = parse_int(_read(self.pids / "pids.peak") or "")
        return peak if peak is not None else parse_int(_read(self.pids / "pids.current") or "")


# -- podman's container init, without podman ---------------------------------------------

#: The most ``/proc`` entries one search reads (a host with a fork bomb costs no more).
MAX_PROC_SCAN = 65536


def conmon_name(argv: list[str]) -> str | None:
    """The container name in a conmon command line (``-n NAME``, ``--name NAME`` or
    ``--name=NAME``), None when it has none."""
    for i, arg in enumerate(argv[:400]):
        if arg in ("-n", "--name") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--name="):
            return arg.removeprefix("--name=")
    return None


def conmon_cid(argv: list[str]) -> str | None:
    """The container id in a conmon command line (``-c ID``, ``--cid ID`` or
    ``--cid=ID``), None when it has none."""
    for i, arg in enumerate(argv[:400]):
        if arg in ("-c", "--cid") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--cid="):
            return arg.removeprefix("--cid=")
    return None


def conmon_child(
    name: str, proc: Path = Path("/proc"), *, owner: int = 0, cid: str | None = None
) -> int | None:
    """The init process of podman's container ``name`` (or, with ``cid``, of the
    container of that id, whatever its name: conmon keeps the name it was started
    under, and a claimed pool sandbox was renamed since): the child of its conmon.

    Found in ``/proc``, not by ``podman inspect``: inspect takes the container's lock,
    which a loaded host's ``podman run`` holds through the start, and a short attached
    task could end before any inspect answered.
    A sandbox's processes are visible here too and may name themselves anything, so a
    conmon counts only if it runs as root (the sandbox's uids are mapped, never 0) from
    a root-owned binary named ``conmon``; and its child only once it is in a cgroup
    other than conmon's (before that it is the OCI runtime still creating the init).
    """
    with os.scandir(proc) as it:
        pids = [e.name for _, e in zip(range(MAX_PROC_SCAN), it, strict=False)]
    for pid in pids:
        if not pid.isdigit():
            continue
        base = proc / pid
        if (_read(base / "comm") or "").strip() != "conmon":
            continue
        argv = (_read(base / "cmdline") or "").split("\0")
        ours = conmon_cid(argv) == cid if cid is not None else conmon_name(argv) == name
        if not ours or not _owned_conmon(base, owner):
            continue
        kids = (_read(base / "task" / pid / "children") or "").split()
        own = _read(base / "cgroup")
        for kid in kids[:8]:
            if kid.isdigit() and (theirs := _read(proc / kid / "cgroup")) and theirs != own:
                return int(kid)
        return None
    return None


def _owned_conmon(base: Path, owner: int) -> bool:
    """The process at ``base`` runs as ``owner`` (root) from a file named ``conmon`` that
    ``owner`` owns and nobody else may write."""
    try:
        if base.stat().st_uid != owner:
            return False
        name = (base / "exe").readlink().name
        st = (base / "exe").stat()  # the very file it runs (the magic link), not a path
    except OSError:
        return False
    return name == "conmon" and st.st_uid == owner and not st.st_mode & 0o022


# -- a microVM's VMM process ------------------------------------------------------------


@dataclass
class VmProcess:
    """The QEMU process of a qemu sandbox (the guest's CPU is its CPU, the guest's
    memory its memory): its own figures, by psutil and ``/proc/<pid>/status``."""

    pid: int
    start: float

    @classmethod
    def of_record(cls, data_dir: Path, name: str, vmm: str | None = None) -> VmProcess | None:
        """From the detached VM's record (``vm``: [name, pid, start]), checked to be that
        very process (its start time) and a QEMU."""
        import psutil

        text = _read(data_dir / "microvm-detached" / f"{name}.json")
        try:
            vm = json.loads(text or "").get("vm")
            pid, start = int(vm[1]), float(vm[2])
            proc = psutil.Process(pid)
            if abs(proc.create_time() - start) > 0.01:  # that very process, not a reused pid
                return None
            if vmm is not None and vmm not in proc.name():  # and the backend's VMM
                return None
        except (ValueError, TypeError, AttributeError, IndexError, KeyError, psutil.Error):
            return None
        return cls(pid, start)

    def sample(self, u: Usage) -> bool:
        """Fold one sample into ``u``; False once the process is gone (or another)."""
        import psutil

        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.start) > 0.01:
                return False
            with proc.oneshot():
                cpu = proc.cpu_times()
                io = proc.io_counters()
        except psutil.Error:
            return False
        u.cpu_s = round(max(u.cpu_s or 0.0, cpu.user + cpu.system), 3)
        u.disk_written_bytes = _max(u.disk_written_bytes, io.write_bytes)
        hwm = parse_status_kb(_read(Path(f"/proc/{self.pid}/status")) or "", "VmHWM")
        u.memory_peak_bytes = _max(u.memory_peak_bytes, hwm)
        u.samples += 1
        return True


# -- the figures ----------------------------------------------------------------------


@dataclass
class Usage:
    """A task's resource figures (None: not measured); see the module docstring."""

    cpu_s: float | None = None
    memory_peak_bytes: int | None = None
    memory_anon_peak_bytes: int | None = None
    disk_written_bytes: int | None = None
    disk_device_written_bytes: int | None = None
    """What reached the workspace's loop device: with the filesystem's own writes
    (journal, ext4's lazy inode-table init after the mount)."""
    disk_peak_bytes: int | None = None
    processes_peak: int | None = None
    processes_started: int | None = None
    """Always None on a cgroup (no fork counter); kept so a reader sees it is unknown."""
    processes_seen: int | None = None
    """Distinct processes seen across the samples (a lower bound of those started)."""
    tasks_peak: int | None = None
    egress_bytes: int | None = None
    source: str = ""
    live: bool = False
    samples: int = 0
    updated_at: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _kind(backend: str) -> str:
    """The backend's kind (container, microvm, process); "" for a name not registered."""
    from agentbox.backends import backend_class
    from agentbox.errors import AgentboxError

    try:
        return str(backend_class(backend).kind)
    except AgentboxError:
        return ""


def _vmm(backend: str) -> str | None:
    """What the name of the backend's VMM process contains (``vmm_process``), if it says."""
    return _trait(backend, "vmm_process")


def _trait(backend: str, name: str) -> str | None:
    """A string trait of the backend's class (None: it has none, or no such backend)."""
    from agentbox.backends import backend_class
    from agentbox.errors import AgentboxError

    try:
        got = getattr(backend_class(backend), name, None)
    except AgentboxError:
        return None
    return got if isinstance(got, str) else None


class Sampler:
    """Samples the sandbox ``name``'s cgroup and workspace disk on a thread until
    :meth:`stop`; writes ``resources.json`` in ``task_root`` as it goes."""

    def __init__(self, task_root: Path, backend: str, name: str, workspace: Path) -> None:
        self.task_root, self.backend, self.name = task_root, backend, name
        self.workspace = workspace
        self.kind = _kind(backend)
        self._vmm = _vmm(backend)
        self._conmon = _trait(backend, "init_parent_process") == "conmon"
        what = "the VM's process" if self.kind == "microvm" else f"the {backend} container's cgroup"
        self.usage = Usage(source=what, live=True)
        self._stop = threading.Event()
        self._cg: Cgroup | None = None
        self._vm: VmProcess | None = None
        self._seen: set[int] = set()
        self._loop: str | None = None
        self._backing: str | None = None
        self._sectors0: int | None = None
        self._ws_dev: int | None = None
        self._next_find = 0.0
        self._finds = 0
        self._cg_gone = False
        self._next_disk = 0.0
        self._written0 = 0
        self._seed(read_resources(task_root))
        self._thread = threading.Thread(
            target=self._run, name=f"agentbox-resources-{name}", daemon=True
        )

    def _seed(self, prior: Mapping[str, Any] | None) -> None:
        """A re-adopted sandbox: the dead launcher's figures are where this one starts
        (the cgroup's counters are cumulative; the disk's are counted from here on top)."""
        if not prior:
            return
        u = self.usage
        for key in (
            "memory_peak_bytes",
            "memory_anon_peak_bytes",
            "disk_peak_bytes",
            "processes_peak",
            "processes_seen",
            "tasks_peak",
            "samples",
        ):
            v = prior.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                setattr(u, key, v)
        cpu = prior.get("cpu_s")
        if isinstance(cpu, int | float) and not isinstance(cpu, bool) and cpu >= 0:
            u.cpu_s = float(cpu)
        for key in ("disk_written_bytes",):
            v = prior.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                u.disk_written_bytes = v
        written = prior.get("disk_device_written_bytes")
        if isinstance(written, int) and not isinstance(written, bool) and written >= 0:
            self._written0 = u.disk_device_written_bytes = written
            u.notes.append("re-adopted: disk writes while no launcher watched are not counted")

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> Usage:
        """Stop sampling (the sandbox has ended), read the disk once more, write the file."""
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(OSError, ValueError):
            self._disk(final=True)
        self.usage.live = False
        self._write()
        return self.usage

    # -- internals

    def _run(self) -> None:
        last_write = 0.0
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # a sampler never fails its task
                log.debug("resource sample failed", sandbox=self.name, error=str(exc)[-200:])
            now = time.monotonic()
            # Never after a stop: the final file is stop()'s (a slow inspect may outlast
            # its join).
            if now - last_write >= WRITE_EVERY and not self._stop.is_set():
                self._write()
                last_write = now
            self._stop.wait(SAMPLE_EVERY)

    def _sample(self) -> None:
        u = self.usage
        if self.kind == "microvm":
            self._sample_vm()
            return
        if self._cg is None and not self._cg_gone and time.monotonic() >= self._next_find:
            # Every second while a sandbox is likely starting (a short attached task must
            # not be missed), then backing off (2, 4, 8 … 30 s): an inspect costs a process.
            late = self._finds - EAGER_FINDS
            wait = 1.0 if late < 0 else FIND_EVERY * 2**late
            self._next_find = time.monotonic() + min(wait, 30.0)
            self._finds += 1
            self._cg = self._find()
        if self._cg is not None:
            cpu = self._cg.cpu_ns()
            if cpu is None and self._cg.memory_peak() is None:
                self._cg, self._cg_gone = None, True  # gone (the sandbox ended): no more
            else:
                if cpu is not None:
                    u.cpu_s = round(max(u.cpu_s or 0.0, cpu / 1e9), 3)
                u.memory_peak_bytes = _max(u.memory_peak_bytes, self._cg.memory_peak())
                u.memory_anon_peak_bytes = _max(u.memory_anon_peak_bytes, self._cg.memory_anon())
                procs = self._cg.processes()
                if procs is not None:
                    u.disk_written_bytes = _max(u.disk_written_bytes, written_by(procs))
                    self._seen |= procs
                    u.processes_peak = _max(u.processes_peak, len(procs))
                    u.processes_seen = len(self._seen)
                u.tasks_peak = _max(u.tasks_peak, self._cg.tasks_peak())
                u.samples += 1
        self._disk(final=False)

    def _sample_vm(self) -> None:
        if self._vm is None and not self._cg_gone and time.monotonic() >= self._next_find:
            self._next_find = time.monotonic() + FIND_EVERY
            self._vm = VmProcess.of_record(self.task_root.parent.parent, self.name, self._vmm)
        if self._vm is not None and not self._vm.sample(self.usage):
            self._vm, self._cg_gone = None, True

    def _find(self) -> Cgroup | None:
        """The cgroup of the sandbox's init process: podman's from its conmon in
        ``/proc`` (:func:`conmon_child`; a claimed pool sandbox's by the container id
        its claim record names), else the engine's ``inspect``."""
        if self.kind != "container":
            return None
        if self._conmon:
            # One scan of /proc: by the id a claim record names, else by the name.
            cid = self._claimed_id()
            init = conmon_child(self.name) if cid is None else conmon_child(self.name, cid=cid)
            if init is not None:
                return Cgroup.of_pid(init)
        from agentbox.core import proc as _proc
        from agentbox.errors import AgentboxError

        try:
            res = _proc.run(
                [self.backend, "inspect", "--format", "{{.State.Pid}}", self.name],
                timeout=10,
                check=False,
            )
        except AgentboxError:
            return None
        pid = parse_int(res.stdout) if res.returncode == 0 else None
        if not pid:
            return None
        return Cgroup.of_pid(pid)

    def _claimed_id(self) -> str | None:
        """The container id of the pool sandbox claimed under this name (its claim
        record, ``<data dir>/pool/claims/NAME.json``), or None: not a claimed one."""
        from agentbox.backends.podman import claim_record

        rec = claim_record(self.task_root.parent.parent / "pool", self.name)
        cid = rec.get("id") if rec is not None else None
        if isinstance(cid, str) and 12 <= len(cid) <= 64 and all(c in HEX for c in cid):
            return cid
        return None

    def _disk(self, *, final: bool) -> None:
        u = self.usage
        if self._loop is None and not final:
            if self.kind != "container" or time.monotonic() < self._next_disk:
                return  # a loop-mounted workspace is theirs; looked for every 2 s
            self._next_disk = time.monotonic() + FIND_EVERY
            info = None
            with contextlib.suppress(OSError):
                info = Path("/proc/self/mountinfo").read_text()
            src = mount_source(info or "", str(self.workspace))
            if src is None or not src.startswith("/dev/loop") or not src[9:].isdigit():
                return
            self._loop = src[5:]
            self._backing = _read(Path(f"/sys/block/{self._loop}/loop/backing_file"))
            self._sectors0 = parse_sectors_written(_read(self._stat_path()) or "")
            with contextlib.suppress(OSError):
                self._ws_dev = self.workspace.stat().st_dev
        if self._loop is None or self._sectors0 is None:
            return
        backing = _read(Path(f"/sys/block/{self._loop}/loop/backing_file"))
        # Detached (after the unmount: the stats stay, cumulative) or still ours; a loop
        # device another mount took since is not read.
        if backing is not None and backing != self._backing:
            if final:
                u.notes.append("disk written: the last writes after the unmount not read")
            return
        sectors = parse_sectors_written(_read(self._stat_path()) or "")
        if sectors is not None and sectors >= self._sectors0:
            written = self._written0 + (sectors - self._sectors0) * _SECTOR
            u.disk_device_written_bytes = _max(u.disk_device_written_bytes, written)
        if not final and self._ws_dev is not None:
            with contextlib.suppress(OSError):
                if self.workspace.stat().st_dev == self._ws_dev:
                    st = os.statvfs(self.workspace)
                    used = (st.f_blocks - st.f_bfree) * st.f_frsize
                    u.disk_peak_bytes = _max(u.disk_peak_bytes, used)

    def _stat_path(self) -> Path:
        return Path(f"/sys/block/{self._loop}/stat")

    def _write(self) -> None:
        self.usage.updated_at = round(time.time(), 3)
        write_resources(self.task_root, self.usage.as_json())


def write_resources(task_root: Path, data: Mapping[str, Any]) -> None:
    """``resources.json`` in the task dir, atomically."""
    tmp = task_root / (RESOURCES_FILE + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data))
        tmp.replace(task_root / RESOURCES_FILE)


def read_resources(task_root: Path) -> dict[str, Any] | None:
    """The task's ``resources.json`` (None: none, or unreadable)."""
    text = _read(task_root / RESOURCES_FILE)
    if text is None:
        return None
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict):
            return data
    return None


@contextlib.contextmanager
def watch(task_root: Path, backend: str, name: str, workspace: Path) -> Iterator[Sampler]:
    """Sample the sandbox ``name`` while the block runs (it runs or follows the sandbox)."""
    sampler = Sampler(task_root, backend, name, workspace).start()
    try:
        yield sampler
    finally:
        with contextlib.suppress(Exception):
            sampler.stop()


def _egress_bytes(summary: object) -> int | None:
    if not isinstance(summary, dict):
        return None
    total = 0
    for key in ("bytes_up", "bytes_down"):
        v = summary.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            total += v
    return total


def final_resources(task_root: Path, report: Mapping[str, Any]) -> dict[str, Any]:
    """The report's ``resources``: the sampler's last figures plus the egress bytes from
    the report's summaries (0 when no proxy ran: nothing could leave), written back to
    ``resources.json`` so that ``show``/``tasks --json`` say the same."""
    data = (
        read_resources(task_root) or Usage(source="none: the sandbox was never sampled").as_json()
    )
    setup = report.get("setup")
    parts = [_egress_bytes(report.get("egress"))]
    if isinstance(setup, dict):
        parts.append(_egress_bytes(setup.get("egress")))
    data["egress_bytes"] = sum(p for p in parts if p is not None)
    data["live"] = False
    write_resources(task_root, data)
    return data


def _size(n: object) -> str | None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return None  # pragma: no cover


def resources_words(data: object) -> str | None:
    """One line for ``show`` and MCP: ``cpu 3.2 s · memory peak 142.0 MB · …`` (None:
    nothing measured). Our own figures only: no text the sandbox chose."""
    if not isinstance(data, dict):
        return None
    parts = []
    cpu = data.get("cpu_s")
    if isinstance(cpu, int | float) and not isinstance(cpu, bool):
        parts.append(f"cpu {cpu:.1f} s")
    if (mem := _size(data.get("memory_peak_bytes"))) is not None:
        parts.append(f"memory peak {mem}")
    if (written := _size(data.get("disk_written_bytes"))) is not None:
        peak = _size(data.get("disk_peak_bytes"))
        parts.append(f"disk written {written}" + (f" (used at most {peak})" if peak else ""))
    procs = data.get("processes_peak")
    if isinstance(procs, int) and not isinstance(procs, bool):
        parts.append(f"processes at once {procs}")
    if (egress := _size(data.get("egress_bytes"))) is not None:
        parts.append(f"egress {egress}")
    if not parts:
        return None
    return " · ".join(parts) + (" (live)" if data.get("live") is True else "")
