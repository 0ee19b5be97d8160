"""Host-side posture checks: read a live sandbox's processes from the host.

Everything here takes host pids (a container's processes, or a VMM's), so the
same checks serve podman and the microVM backends. Every *thread* is read
(``/proc/<pid>/task/<tid>/status``): a capability or a missing seccomp filter
on one helper thread is as bad as on the main one. A pid that vanished between
listing and reading is skipped; a sandbox with no readable thread is a failure,
never a pass.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class ThreadStatus:
    """The security-relevant fields of one thread's status."""

    pid: int
    tid: int
    name: str
    uids: tuple[int, ...]
    cap_eff: int
    cap_prm: int
    cap_bnd: int
    no_new_privs: int
    seccomp: int


def _status(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        key, _, val = line.partition(":")
        out[key.strip()] = val.strip()
    return out


def read_threads(pids: Iterable[int]) -> list[ThreadStatus]:
    """Status of every thread of every pid (those that vanished meanwhile are skipped)."""
    out: list[ThreadStatus] = []
    for pid in pids:
        try:
            tids = sorted(int(t.name) for t in (_PROC / str(pid) / "task").iterdir())
        except OSError:
            continue
        for tid in tids:
            try:
                st = _status(_PROC / str(pid) / "task" / str(tid) / "status")
                out.append(
                    ThreadStatus(
                        pid=pid,
                        tid=tid,
                        name=st.get("Name", "?"),
                        uids=tuple(int(u) for u in st.get("Uid", "").split()),
                        cap_eff=int(st.get("CapEff", "0"), 16),
                        cap_prm=int(st.get("CapPrm", "0"), 16),
                        cap_bnd=int(st.get("CapBnd", "0"), 16),
                        no_new_privs=int(st.get("NoNewPrivs", "0")),
                        seccomp=int(st.get("Seccomp", "0")),
                    )
                )
            except (OSError, ValueError):
                continue
    return out


def namespace_differs(pid: int, kind: str) -> tuple[bool, str]:
    """Whether ``pid`` is in a different ``kind`` namespace than this (host) process."""
    try:
        mine = str(Path(f"/proc/self/ns/{kind}").readlink())
        theirs = str(Path(f"/proc/{pid}/ns/{kind}").readlink())
    except OSError as exc:
        return False, f"unreadable: {exc.strerror}"
    return mine != theirs, f"sandbox {theirs} vs host {mine}"


def cgroup_dir(pid: int, controller: str) -> Path | None:
    """The v1 ``controller`` (or unified) cgroup directory of ``pid`` on the host."""
    try:
        lines = (_PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified: Path | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if controller in ctrls.split(","):
            return Path(f"/sys/fs/cgroup/{controller}{path}")
        if ctrls == "":
            unified = Path(f"/sys/fs/cgroup{path}")
    if unified is not None and (unified / "cgroup.controllers").exists():
        return unified
    return None


def cgroup_pids(pid: int) -> list[int]:
    """Every process in ``pid``'s pids cgroup (the whole container), ``pid`` included."""
    d = cgroup_dir(pid, "pids")
    pids: set[int] = {pid}
    if d is not None:
        with contextlib.suppress(OSError):
            pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
    return sorted(pids)


def gateway_posture(pid: int, *, want_uid: int) -> list[tuple[str, bool, str]]:
    """The posture of a task's gateway process, as the VMM's is read: every thread's uid,
    capabilities, NoNewPrivs and seccomp mode, and its address-space limit.

    Returns ``(check id, passed, what was seen)`` for ``gateway.uid``, ``gateway.caps``,
    ``gateway.no_new_privs``, ``gateway.seccomp`` and ``gateway.memory_limit``. The
    gateway parses everything the sandbox sends: it must run as its
    dedicated uid (``want_uid``, never 0), hold no capability (bounding set
    included), have NoNewPrivs=1 and Seccomp=2 on every thread, and a finite RLIMIT_AS.
    No readable thread is a failure, never a pass.
    """
    threads = read_threads([pid])
    n = len(threads)
    if not threads:
        why = f"no readable thread of gateway pid {pid}"
        return [(c, False, why) for c in ("gateway.uid", "gateway.caps", "gateway.no_new_privs",
                                          "gateway.seccomp", "gateway.memory_limit")]  # fmt: skip
    uids = sorted({u for t in threads for u in t.uids})
    caps = [t for t in threads if t.cap_eff or t.cap_prm or t.cap_bnd]
    nnp = [t for t in threads if t.no_new_privs != 1]
    sec = [t for t in threads if t.seccomp != 2]
    limit = "?"
    with contextlib.suppress(OSError):
        for line in (_PROC / str(pid) / "limits").read_text().splitlines():
            if line.startswith("Max address space"):
                limit = line.split()[3]
    return [
        ("gateway.uid", uids == [want_uid] and 0 not in uids,
         f"host uids {uids} (want only {want_uid})"),
        ("gateway.caps", not caps, f"{len(caps)}/{n} threads with a capability"
         + (f" e.g. eff {caps[0].cap_eff:#x} bnd {caps[0].cap_bnd:#x}" if caps else "")),
        ("gateway.no_new_privs", not nnp, f"{n - len(nnp)}/{n} threads NoNewPrivs=1"),
        ("gateway.seccomp", not sec, f"{n - len(sec)}/{n} threads Seccomp=2"),
        ("gateway.memory_limit", limit.isdigit(), f"RLIMIT_AS {limit}"),
    ]  # fmt: skip


@dataclass
class LatencyMeter:
    """Measures how late a host thread wakes from short sleeps (the host's responsiveness).

    Started before the sandbox forks and stopped after; ``worst`` is the largest
    oversleep seen. A pure-Python thread is deliberately what is measured: it is
    what every agentbox host component (launcher, gateway) is.
    """

    interval: float = 0.005
    cgroup: Path | None = None
    """A pids cgroup directory to read ``pids.current`` from at every sample."""
    samples: list[float] = field(default_factory=list)
    peak_pids: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin sampling in a daemon thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="latency-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(self.interval)
            self.samples.append(time.monotonic() - t0 - self.interval)
            if self.cgroup is not None:
                with contextlib.suppress(OSError, ValueError):
                    n = int((self.cgroup / "pids.current").read_text())
                    self.peak_pids = max(self.peak_pids, n)

    def stop(self) -> None:
        """Stop sampling (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    @property
    def worst(self) -> float:
        """The largest oversleep in seconds (0 with no samples)."""
        return max(self.samples, default=0.0)

    @property
    def p99(self) -> float:
        """The 99th percentile oversleep in seconds."""
        if not self.samples:
            return 0.0
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(len(s) * 0.99))]
