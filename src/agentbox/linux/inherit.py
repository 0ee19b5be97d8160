"""What a process inherits from the one that starts it, and taking it on in-process:
the front end's command takes on its caller's, a template's forked gateway its
requester's (each as if that caller had exec'd it)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable, Mapping

#: Every resource limit a process inherits from the one that starts it (``ulimit``).
LIMITS = tuple(
    getattr(resource, n)
    for n in (
        "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE",
        "RLIMIT_LOCKS", "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE", "RLIMIT_NICE", "RLIMIT_NOFILE",
        "RLIMIT_NPROC", "RLIMIT_RSS", "RLIMIT_RTPRIO", "RLIMIT_RTTIME", "RLIMIT_SIGPENDING",
        "RLIMIT_STACK",
    )
    if hasattr(resource, n)
)  # fmt: skip


def take_on(
    *,
    nice: int,
    affinity: Iterable[int],
    oom_score_adj: int,
    limits: Mapping[int, tuple[int, int]],
    umask: int,
) -> None:
    """Set this process's nice value, CPU affinity, OOM score adjustment, resource limits
    and umask, in that order, each only where it differs (a value equal to this process's
    needs no privilege to keep)."""
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    cpus = set(affinity)
    if os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)
    with open("/proc/self/oom_score_adj", "r+") as fh:
        if int(fh.read()) != oom_score_adj:
            fh.seek(0)
            fh.write(str(oom_score_adj))
    for res, pair in limits.items():
        if resource.getrlimit(res) != pair:
            resource.setrlimit(res, pair)
    os.umask(umask)
