""" "Nothing survived": what a destroyed sandbox may not leave on the host, checked.

A :class:`SandboxTracker` wraps one backend in a test: every sandbox it makes
(``create``), runs (``run``), launches detached (``launch``) or pools
(``fill_pool``) is remembered, with the host pids and cgroups it had while
alive; one made elsewhere (by a launcher, adopted by name) is registered with
``track(name, box=None)``; code that takes a backend gets ``proxy()``, whose
sandbox-making calls go through the tracker. :meth:`SandboxTracker.leftovers`
then looks on the host, by the sandbox's name and by what was recorded, for

* a **process**: a recorded pid still running (same start time), or any process
  whose command line names the sandbox (conmon's ``-n NAME``, QEMU's ``-name``)
  or one of its microVMs (``NAME-<6 hex>``: the VM dir QEMU's arguments name);
* a **cgroup**: a recorded cgroup directory still present, or a microVM's
  (``agentbox/NAME-<6 hex>``, found by name: a detached VM's pids are not recorded);
* a **container**: ``podman ps -a`` (or ``docker ps -a`` for the docker backend)
  still lists the name, or the backend's ``owned()`` does;
* a **VM dir**: a ``microvm/*/owner`` file under the data dir naming it;
* a **staged pool disk**: a pooled slot's ``pool-disks/<slot>.img`` or its mount point;
* a **socket**: a unix socket (``/proc/net/unix``) whose path names it;
* an **env fd**: a sealed environment memfd (``memfd:agentbox-env``) this process
  holds beyond what it held when the tracker started.

Like Firecracker's ``Microvm.kill()``, a removal may take a moment to settle:
:meth:`assert_clean` waits a bounded time for the host to catch up, then fails
naming everything that survived. :meth:`save_artifacts` writes the posture,
host pids and the data dir's logs of live sandboxes for a failed test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.backends.base import LABEL, Backend, ExecResult, Sandbox, SandboxSpec
from agentbox.config import Settings

__all__ = ["ENV_MEMFD", "SandboxTracker", "active_trackers", "env_fds", "process_start"]

ENV_MEMFD = "/memfd:agentbox-env"
#: What a microVM's name adds to its sandbox's (``backends/microvm``: ``token_hex(3)``).
_VM_SUFFIX = "[0-9a-f]{6}"
_ACTIVE: list[SandboxTracker] = []


def active_trackers() -> list[SandboxTracker]:
    """The trackers of the tests running now (for the failure hook)."""
    return list(_ACTIVE)


def process_start(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else ""


def env_fds() -> int:
    """How many environment memfds this process holds open."""
    n = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(ENV_MEMFD):
                    n += 1
    return n


def _cgroups_of(pid: int) -> set[Path]:
    found: set[Path] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, ctrls, path = ([*line.split(":", 2), "", ""])[:3]
            if path in ("", "/"):
                continue
            if ctrls == "":
                found.add(Path(f"/sys/fs/cgroup{path}"))
            elif "pids" in ctrls.split(","):
                found.add(Path(f"/sys/fs/cgroup/pids{path}"))
    return found


@dataclass
class _Seen:
    name: str
    pids: dict[int, str] = field(default_factory=dict)
    cgroups: set[Path] = field(default_factory=set)
    box: Sandbox | None = None


class SandboxTracker:
    """Makes sandboxes of ``backend`` and checks afterwards that none left anything."""

    def __init__(self, backend: Backend, settings: Settings) -> None:
        self.backend = backend
        self.settings = settings
        self.seen: dict[str, _Seen] = {}
        self._env_fds = env_fds()
        self._own_cgroups = _cgroups_of(os.getpid())
        self._clean = False
        _ACTIVE.append(self)

    # -- making sandboxes

    def create(self, spec: SandboxSpec) -> Sandbox:
        seen = self.seen.setdefault(spec.name, _Seen(spec.name))
        box = self.backend.create(spec)
        seen.box = box
        self._record(seen, box)
        return box

    def run(self, spec: SandboxSpec, argv: Sequence[str], **kw: Any) -> ExecResult:
        self.seen.setdefault(spec.name, _Seen(spec.name))
        return self.backend.run(spec, argv, **kw)

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """``backend.launch`` (detached), the sandbox remembered by name."""
        self.seen.setdefault(spec.name, _Seen(spec.name))
        self.backend.launch(spec, argv, log=log)

    def fill_pool(self, template: SandboxSpec, size: int, *, ttl: float) -> list[str]:
        """``backend.fill_pool``, every pooled sandbox remembered by name."""
        names = self.backend.fill_pool(template, size, ttl=ttl)
        for name in names:
            self.track(name)
        return names

    def track(self, name: str, box: Sandbox | None = None) -> None:
        """Remember a sandbox made elsewhere (by a launcher, detached, pooled, adopted
        by name): its name is checked like the others'. Given ``box`` (live), its host
        pids and cgroups are recorded too, and it is destroyed on :meth:`close`.
        Calling it again for the same name records more pids."""
        seen = self.seen.setdefault(name, _Seen(name))
        if box is not None:
            seen.box = box
            self._record(seen, box)

    def proxy(self) -> Backend:
        """The backend, with ``create``/``run``/``launch``/``fill_pool`` going through
        this tracker: for code that takes a backend and makes sandboxes of its own."""
        return _Tracking(self)  # type: ignore[return-value]

    def _record(self, seen: _Seen, box: Sandbox) -> None:
        try:
            pids = box.host_pids()
        except Exception:  # a sandbox not yet running has none to record
            return
        for pid in pids:
            seen.pids[pid] = process_start(pid)
            seen.cgroups |= _cgroups_of(pid) - self._own_cgroups

    # -- checking

    def leftovers(self) -> list[str]:
        """Everything of every sandbox made here that is still on the host."""
        left: list[str] = []
        names = set(self.seen)
        for seen in self.seen.values():
            for pid, start in seen.pids.items():
                if start and process_start(pid) == start:
                    left.append(f"{seen.name}: process {pid} still runs")
            left += [f"{seen.name}: cgroup {cg} remains" for cg in seen.cgroups if cg.exists()]
        left += self._processes_naming(names)
        left += self._vm_cgroups(names)
        fake = type(self.backend).__module__ == "agentbox.backends.fake"
        if os.geteuid() == 0 and not fake:  # the in-process fake makes no container
            left += _engine_containers("podman", names, "container")
        if type(self.backend).__module__.startswith("agentbox.backends.docker"):
            left += _engine_containers("docker", names, "docker container")
        left += self._owned(names)
        left += self._vm_dirs(names)
        left += self._pool_disks(names)
        left += self._sockets(names)
        extra = env_fds() - self._env_fds
        if extra > 0:
            left.append(f"{extra} environment memfd(s) still open in the test process")
        return left

    def assert_clean(self, settle: float = 10.0) -> None:
        """Fail naming what survived, after ``settle`` seconds for removals to finish."""
        end = time.monotonic() + settle
        while (left := self.leftovers()) and time.monotonic() < end:
            time.sleep(0.2)
        assert not left, "the sandbox left things behind:\n" + "\n".join(left)
        self._clean = True

    def close(self) -> None:
        """Destroy what is still live (after a failure: a sandbox known only by name is
        reaped by the backend, so a failed test leaves nothing for the next) and stop
        being active."""
        for seen in self.seen.values():
            with contextlib.suppress(Exception):
                if seen.box is not None:
                    seen.box.destroy()
                elif not self._clean:
                    self.backend.reap(seen.name)
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(self)

    @staticmethod
    def _processes_naming(names: set[str]) -> list[str]:
        left = []
        me = os.getpid()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == me:
                continue
            try:
                args = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = [a.decode(errors="replace") for a in args]
            for name in names:
                vm = rf"(^|[=/ ,]){re.escape(name)}(-{_VM_SUFFIX})?($|[,/ ])"
                if any(re.search(vm, a) for a in text):
                    left.append(f"{name}: process {d.name} names it: {' '.join(text)[:160]}")
        return left

    @staticmethod
    def _vm_cgroups(names: set[str]) -> list[str]:
        """A microVM's cgroups (``<hierarchy>/agentbox/<sandbox>-<6 hex>``) still present."""
        left = []
        for parent in (*Path("/sys/fs/cgroup").glob("*/agentbox"), Path("/sys/fs/cgroup/agentbox")):
            with contextlib.suppress(OSError):
                for d in parent.iterdir():
                    stem, _, suffix = d.name.rpartition("-")
                    if d.is_dir() and stem in names and re.fullmatch(_VM_SUFFIX, suffix):
                        left.append(f"{stem}: cgroup {d} remains")
        return left

    def _owned(self, names: set[str]) -> list[str]:
        try:
            owned = self.backend.owned()
        except Exception as exc:  # a backend that cannot list says so, as a survivor
            return [f"backend.owned() failed: {exc}"]
        return [f"{n}: still owned by the backend's data dir" for n in owned if n in names]

    def _vm_dirs(self, names: set[str]) -> list[str]:
        left = []
        base = self.settings.data_dir / "microvm"
        if base.is_dir():
            for d in base.iterdir():
                with contextlib.suppress(OSError, ValueError):
                    owner = json.loads((d / "owner").read_text())
                    if isinstance(owner, dict) and owner.get(LABEL) in names:
                        left.append(f"{owner[LABEL]}: VM dir {d} remains")
        return left

    def _pool_disks(self, names: set[str]) -> list[str]:
        """A pooled slot's staged workspace disk (``pool-disks/<slot>.img`` and its mount
        point ``<slot>.d``): moved over a task's workspace at claim, else dropped with its
        slot (a mount left there keeps the ``.d`` directory)."""
        base = self.settings.data_dir / "pool-disks"
        return [
            f"{n}: staged pool disk {p} remains"
            for n in sorted(names)
            for p in (base / f"{n}.img", base / f"{n}.d")
            if os.path.lexists(p)
        ]

    @staticmethod
    def _sockets(names: set[str]) -> list[str]:
        left = []
        with contextlib.suppress(OSError):
            for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
                parts = line.split()
                path = parts[7] if len(parts) > 7 else ""
                left += [f"{n}: socket {path} remains" for n in names if n in path]
        return left

    # -- artifacts of a failed test

    def save_artifacts(self, into: Path) -> list[Path]:
        """Write the posture and host pids of each live sandbox, and the data dir's logs."""
        into.mkdir(parents=True, exist_ok=True)
        saved = []
        for seen in self.seen.values():
            info: dict[str, Any] = {"name": seen.name, "recorded_pids": seen.pids}
            box = seen.box
            if box is not None:
                for what, read in (("posture", lambda b: b.posture().to_dict()),
                                   ("host_pids", lambda b: b.host_pids())):  # fmt: skip
                    try:
                        info[what] = read(box)
                    except Exception as exc:  # a dead sandbox says why
                        info[what] = f"unreadable: {exc}"
            out = into / f"{seen.name}.json"
            out.write_text(json.dumps(info, indent=2, default=str))
            saved.append(out)
        for log in _logs(self.settings.data_dir):
            dest = into / "logs" / log.relative_to(self.settings.data_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copyfile(log, dest)
                saved.append(dest)
        return saved


class _Tracking:
    """A backend whose sandbox-making calls go through a :class:`SandboxTracker`."""

    def __init__(self, tracker: SandboxTracker) -> None:
        self._tracker = tracker
        self.create = tracker.create
        self.run = tracker.run
        self.launch = tracker.launch
        self.fill_pool = tracker.fill_pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker.backend, name)


def _logs(root: Path) -> Iterator[Path]:
    with contextlib.suppress(OSError):
        for p in root.rglob("*.log"):
            if p.is_file() and not p.is_symlink():
                yield p


def _engine_containers(cli: str, names: set[str], what: str) -> list[str]:
    """The containers ``cli ps -a`` lists under one of ``names`` (none without the CLI)."""
    if not names or shutil.which(cli) is None:
        return []
    res = subprocess.run(
        [cli, "ps", "-a", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return [f"{n}: {what} remains" for n in res.stdout.split() if n in names]
