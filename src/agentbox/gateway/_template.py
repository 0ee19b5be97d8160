"""The gateway template: one process per launcher that forks each task's gateway.

A gateway is a whole Python interpreter, and ~90% of its memory is the state of
its imports. The template (``python -m agentbox.gateway._template --fd N``)
imports and prepares everything a gateway needs once, freezes it
(:func:`gc.freeze`: the collector no longer writes to those objects, so their pages
stay shared), says ``ready`` on the socket ``N`` it was given, and then serves that
socket (a ``SOCK_SEQPACKET`` pair end; only the launcher holds the other):

- request: one JSON message (``argv``, ``env``, ``cgroups``, ``posture``) with the task's
  descriptors attached (``SCM_RIGHTS``): its listening socket, its ready pipe, its log
  file, a pipe carrying the gateway's secret environment (the upstream key), which only
  the gateway reads (the template never holds a task's secret), and the requester's
  mount namespace;
- ``posture`` is what a process the requester started would inherit from it (nice value,
  CPU affinity, OOM score adjustment, resource limits, umask; :func:`own_posture`),
  checked against the template's own (:func:`parse_posture`: never more than the
  template has), and taken on by the child, with the requester's mount namespace
  (``setns``), while it is still privileged (:func:`_take_on`): the gateway then has an
  exec'd one's posture whoever asked, a served caller whose shell is not the
  ``launcher serve`` unit's too;
- the template forks, and the child becomes the task's gateway (:func:`_become_gateway`):
  in a session of its own, reaped by the kernel (the template ignores ``SIGCHLD``), it
  outlives the template and the launcher as an exec'd gateway does (init adopts it);
- reply: ``{"pid": N}`` once the gateway has named itself (its command line is the
  exec'd gateway's, so re-adoption and orphan sweeps see the same process), or
  ``{"error": "..."}``.

The template exits when the launcher's end closes (and every further channel it gave
out, see :func:`_answer`). It never reads a file or a secret of a task: all it gets of
one are descriptors it forwards.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from agentbox.linux.inherit import LIMITS, take_on

#: Descriptors a request attaches, in this order: a gateway's, then the requester's
#: mount namespace (``/proc/self/ns/mnt``), which the template's child joins.
FD_NAMES = ("listener", "ready", "log", "secrets", "mntns")
#: Where the forked gateway finds them (the argv it names itself with says so).
LISTEN_FD, READY_FD = 3, 4
#: The largest request message (argv, environment, cgroup paths).
MAX_REQUEST = 64 << 10
#: Seconds the template waits for a forked gateway to name itself.
CHILD_REPORT_TIMEOUT = 10.0

_PR_SET_NAME = 15
_CLONE_NEWNS = 0x00020000
#: ``ioctl_ns(2)``: a namespace descriptor's type, and its owning user namespace.
_NS_GET_USERNS, _NS_GET_NSTYPE = 0xB701, 0xB703
_PR_SET_MM = 35
_PR_SET_MM_MAP = 14


#: ``struct prctl_mm_map``'s address fields, in order (all ``__u64``).
_MM_FIELDS = (
    "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
    "start_stack", "arg_start", "arg_end", "env_start", "env_end",
)  # fmt: skip


class _MMMap(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_uint64) for name in _MM_FIELDS),
        ("auxv", ctypes.c_void_p),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]


#: Kept alive for the process's life: the memory ``/proc/self/cmdline`` now reads.
_ARGV_BLOCK: list[Any] = []


def set_cmdline(argv: list[str]) -> None:
    """Make ``/proc/self/cmdline`` read ``argv`` (and ``comm`` its program's name).

    ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` with every field as it is but the argument
    block, which points at a new buffer: no privilege needed (no executable changed),
    and nothing of the environment block is overwritten (glibc's ``environ`` still
    points there). Raises OSError when the kernel refuses (no CONFIG_CHECKPOINT_RESTORE).
    """
    from agentbox.linux.libc import libc

    lib = libc()
    raw = open("/proc/self/stat").read()  # noqa: SIM115 (read at once; closed by refcount)
    fields = raw[raw.rindex(")") + 2 :].split()

    def field(n: int) -> int:  # proc(5)'s field numbers: field 3 (state) is fields[0]
        return int(fields[n - 3])

    data = b"".join(a.encode() + b"\0" for a in argv)
    buf = ctypes.create_string_buffer(data, len(data))
    lib.sbrk.restype = ctypes.c_void_p
    start = ctypes.addressof(buf)
    mm = _MMMap(
        start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
        start_brk=field(47), brk=lib.sbrk(0) or field(47), start_stack=field(28),
        arg_start=start, arg_end=start + len(data), env_start=field(50), env_end=field(51),
        auxv=None, auxv_size=0, exe_fd=0xFFFFFFFF,
    )  # fmt: skip
    if lib.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_MM_MAP): {os.strerror(err)}")
    _ARGV_BLOCK.append(buf)
    name = b"agentbox-gw"
    lib.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


@dataclass(frozen=True)
class Posture:
    """What a gateway takes on from whoever asked for it (:func:`own_posture`'s fields)."""

    nice: int
    affinity: frozenset[int]
    oom_score_adj: int
    limits: dict[int, tuple[int, int]]
    umask: int

    @classmethod
    def of(cls, doc: dict[str, Any]) -> Posture:
        """From :func:`own_posture` of this very process (unchecked: for trusted values)."""
        limits = {int(r): (int(v[0]), int(v[1])) for r, v in doc["limits"].items()}
        return cls(doc["nice"], frozenset(doc["affinity"]), doc["oom_score_adj"], limits,
                   doc["umask"])  # fmt: skip


def own_posture() -> dict[str, Any]:
    """What a process this thread started now would inherit from it, as a request
    carries it: nice value and CPU affinity (the calling thread's: ``fork`` copies the
    thread's), OOM score adjustment, every resource limit, umask (read from
    ``/proc/self/status``: ``umask()`` would change it under other threads)."""
    umask = None
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
                break
    if umask is None:
        raise OSError("no Umask in /proc/self/status")
    with open("/proc/self/oom_score_adj") as fh:
        oom = int(fh.read())
    return {
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "oom_score_adj": oom,
        "limits": {str(int(r)): list(resource.getrlimit(r)) for r in LIMITS},
        "umask": umask,
    }


def _bounded(value: object, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"posture: {what} {value!r} is not within [{low}, {high}]")
    return value


def _rlim(v: int) -> float:
    """A limit's value for comparing (``RLIM_INFINITY`` is -1 in Python: the largest)."""
    return float("inf") if v == resource.RLIM_INFINITY else float(v)


def parse_posture(raw: object, own: Posture) -> Posture:
    """A request's ``posture``, checked against ``own`` (this template's): the gateway
    may take on less than the template has, never more. Its nice value may not be below
    the template's (a higher priority), nor its OOM score adjustment (less likely to be
    killed); its CPUs are some of the template's; no limit is above the template's hard
    limit; the umask is any (it only takes permissions away). ValueError otherwise
    (the requester then execs its gateway, which inherits from it)."""
    keys = {"nice", "affinity", "oom_score_adj", "limits", "umask"}
    if not isinstance(raw, dict) or set(raw) != keys:
        raise ValueError("posture: not a map of " + ", ".join(sorted(keys)))
    nice = _bounded(raw["nice"], own.nice, 19, "nice")
    cpus = raw["affinity"]
    if not (isinstance(cpus, list) and 0 < len(cpus) <= 1 << 16):
        raise ValueError("posture: affinity is not a list of CPUs")
    if not all(type(c) is int for c in cpus) or not set(cpus) <= own.affinity:
        raise ValueError("posture: affinity names a CPU the template may not run on")
    oom = _bounded(raw["oom_score_adj"], own.oom_score_adj, 1000, "oom_score_adj")
    limits = raw["limits"]
    if not (isinstance(limits, dict) and set(limits) == {str(r) for r in own.limits}):
        raise ValueError("posture: limits do not name every resource limit")
    taken: dict[int, tuple[int, int]] = {}
    for res, (_, own_hard) in own.limits.items():
        pair = limits[str(res)]
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"posture: limit {res} is not [soft, hard]")
        soft, hard = (_bounded(v, -1, (1 << 63) - 1, f"limit {res}") for v in pair)
        if not _rlim(soft) <= _rlim(hard) <= _rlim(own_hard):
            raise ValueError(f"posture: limit {res} {pair} is above the template's hard limit")
        taken[res] = (soft, hard)
    umask = _bounded(raw["umask"], 0, 0o777, "umask")
    return Posture(nice, frozenset(cpus), oom, taken, umask)


_own: Posture | None = None


def _template_posture() -> Posture:
    global _own
    if _own is None:  # read once: nothing changes this process's
        _own = Posture.of(own_posture())
    return _own


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _mount_ns(fd: int) -> int | None:
    """``fd`` when it is a mount namespace other than this process's, owned by this
    process's user namespace (one a requester of the template's rights may hand; never a
    sandbox's, owned by a user namespace of its own); None when it is this process's own.
    ValueError for any other descriptor."""
    import fcntl

    try:
        kind = fcntl.ioctl(fd, _NS_GET_NSTYPE)
    except OSError as exc:
        raise ValueError(f"the mount namespace sent is no namespace: {exc}") from exc
    if kind != _CLONE_NEWNS:
        raise ValueError("the namespace sent is not a mount namespace")
    if _same_file(os.fstat(fd), Path("/proc/self/ns/mnt").stat()):
        return None
    try:
        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
    except OSError as exc:
        raise ValueError(f"the mount namespace's owner is not ours to see: {exc}") from exc
    try:
        if not _same_file(os.fstat(owner), Path("/proc/self/ns/user").stat()):
            raise ValueError("the mount namespace sent is another user namespace's")
    finally:
        os.close(owner)
    return fd


def _take_on(posture: Posture, mntns: int | None) -> None:
    """In the child, still privileged (before the gateway drops its uid, empties its
    capabilities, sets no_new_privs and loads its filter): the requester's mount
    namespace (its root must be this process's: what the front end checks of a caller),
    nice value, CPU affinity, OOM score adjustment, limits and umask, as a process the
    requester exec'd would have inherited them, in that order (a cgroup's cpuset moved
    into afterwards narrows the affinity as it would an exec'd gateway's)."""
    if mntns is not None:
        from agentbox.linux.libc import libc

        root = Path("/").stat()
        if libc().setns(mntns, _CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot join the requester's mount namespace: {os.strerror(err)}")
        if not _same_file(root, Path("/").stat()):
            raise OSError("the requester's mount namespace has another root directory")
    take_on(nice=posture.nice, affinity=posture.affinity, oom_score_adj=posture.oom_score_adj,
            limits=posture.limits, umask=posture.umask)  # fmt: skip


def prepare() -> None:
    """Import and load what a gateway would at its start and first request, then freeze."""
    from agentbox.gateway.__main__ import BLOCKED

    for name in BLOCKED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    import concurrent.futures.thread  # noqa: F401  (the usage writer's executor)
    import encodings.idna  # noqa: F401  (name resolution, on the first upstream call)
    import random  # noqa: F401  (reseeded in each child by its own fork hook)

    import agentbox.gateway.__main__
    import agentbox.gateway._command
    import agentbox.gateway._logcap
    from agentbox.gateway import _confine, _run, _serve
    from agentbox.gateway._conn import ConnLimits
    from agentbox.gateway._script import load_script
    from agentbox.gateway.registry import DEMO_SCRIPT, load_registry

    # uvicorn imports its protocol and loop modules when a server's config is loaded.
    _serve._config(object(), ConnLimits()).load()
    _confine.prebuild()  # the filter's rules built once; each gateway loads them
    # What a start compiles (argparse's and yaml's patterns) lands in ``re``'s cache.
    agentbox.gateway.__main__.parser().parse_args(["--listen", "unix:/x", "--model", "m"])
    load_script(DEMO_SCRIPT)
    _rehearse(_run, load_registry(None, None).get("replay-demo"))
    gc.collect()
    gc.freeze()
    from agentbox.linux.libc import libc

    libc().malloc_trim(0)  # what the rehearsal freed goes back, not into each fork


def _rehearse(run: Any, entry: Any) -> None:
    """Start and stop a throwaway gateway (replay model, a private directory, no drop):
    the code a gateway runs at its start is then specialised here, once, in pages its
    children share, instead of in each child."""
    import asyncio
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="agentbox-gw-template-"))
    try:
        group, gateway, _ = run.build_gateway(
            listen=f"unix:{tmp / 'g.sock'}", token="t" * 32, entry=entry, budget=1
        )
        ready_r, ready_w = os.pipe()

        async def rehearse() -> None:
            loop = asyncio.get_running_loop()
            said = loop.create_future()
            loop.add_reader(ready_r, said.set_result, None)  # no executor: no thread here
            task = asyncio.ensure_future(group.run(signals=False, ready_fd=ready_w))
            await said
            loop.remove_reader(ready_r)
            group.stop()
            await task
            await gateway.aclose()

        asyncio.run(rehearse())
        os.close(ready_r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    msg, anc, flags, _ = sock.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ValueError("request truncated")
    return msg, list(fds)


def serve(sock: socket.socket) -> None:
    """Answer fork requests until the launcher's end, and every channel given out
    (:func:`_answer`), has closed.

    The gateways are this process's children while it runs (an exec'd gateway is its
    launcher's), reaped by the kernel when they end (``SIGCHLD`` ignored: no zombie, no
    wait); when it exits, init adopts them. One fork, not a double fork that would make
    init their parent at once: each fork copies the template's page tables (~2 ms),
    on the path of every task's start.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    channels = {sock.fileno(): sock}
    while channels:
        ready, _, _ = select.select(list(channels), [], [])
        for fd in ready:
            if not _answer(channels[fd], channels):
                channels.pop(fd).close()


def _answer(sock: socket.socket, channels: dict[int, socket.socket]) -> bool:
    """Answer one request on ``sock``; False once its other end has closed.

    A request ``{"channel": true}`` (no descriptor) is answered with a new channel to
    this template (the other end of a new pair, attached): the front end's fork server
    hands one to each command it forks, so that a served ``agentbox run`` forks its
    gateway here instead of starting a template of its own. The template ends when
    every channel has closed."""
    try:
        msg, fds = _recv(sock)
    except ValueError as exc:
        sock.send(json.dumps({"error": str(exc)}).encode())
        return True
    if not msg:
        return False
    try:
        req = json.loads(msg)
        if not isinstance(req, dict):
            raise ValueError("a request is a JSON object")
        if req.get("channel") is True and not fds:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.set_inheritable(False)
            channels[ours.fileno()] = ours
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno()]))]
            sock.sendmsg([b'{"channel": 1}'], anc)
            theirs.close()
            return True
        reply = _fork_one(sock, req, fds)
    except Exception as exc:
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for fd in fds:
            os.close(fd)
    sock.send(json.dumps(reply).encode())
    return True


def _fork_one(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    if len(fds) != len(FD_NAMES):
        raise ValueError(f"{len(fds)} descriptors, not {len(FD_NAMES)}")
    posture = parse_posture(req.get("posture"), _template_posture())
    mntns = _mount_ns(fds[-1])
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        os.close(report_r)
        os.close(report_w)
        raise
    if pid == 0:
        try:
            os.close(report_r)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # as an exec'd gateway has it
            _become_gateway(sock, req, fds[:-1], report_w, posture, mntns)
        finally:
            os._exit(1)
    os.close(report_w)
    try:
        return _read_report(report_r)
    finally:
        os.close(report_r)


def _read_report(fd: int) -> dict[str, Any]:
    got = b""
    while True:
        ready, _, _ = select.select([fd], [], [], CHILD_REPORT_TIMEOUT)
        if not ready:
            return {"error": f"the forked gateway did not report in {CHILD_REPORT_TIMEOUT:g}s"}
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    if not got:
        return {"error": "the forked gateway exited before it reported"}
    reply: dict[str, Any] = json.loads(got)
    return reply


def _place(fds: list[int]) -> dict[str, int]:
    """Move the received descriptors to where a gateway expects them: 0 ``/dev/null``,
    1 and 2 the log, :data:`LISTEN_FD`, :data:`READY_FD`; the secrets pipe past them."""
    high = {name: os.dup(fd) for name, fd in zip(FD_NAMES[:-1], fds, strict=True)}
    for fd in fds:
        os.close(fd)
    moved = {name: _dup_above(fd, 16) for name, fd in high.items()}
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(moved["log"], 1)
    os.dup2(moved["log"], 2)
    os.dup2(moved["listener"], LISTEN_FD)
    os.dup2(moved["ready"], READY_FD)
    secrets_fd = os.dup2(moved["secrets"], READY_FD + 1)
    for fd in moved.values():
        if fd > READY_FD + 1:
            os.close(fd)
    return {"secrets": secrets_fd}


def _dup_above(fd: int, low: int) -> int:
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD, low)
    os.close(fd)
    return new


def _become_gateway(
    sock: socket.socket,
    req: dict[str, Any],
    fds: list[int],
    report: int,
    posture: Posture,
    mntns: int | None,
) -> NoReturn:
    """In the child: take on the requester's posture, take the task's descriptors, name
    the process as the exec'd gateway, report, and run the gateway's ``main``; never
    returns into the template."""
    code = 1
    try:
        os.setsid()
        _take_on(posture, mntns)
        sock.detach()  # its descriptor is closed below; the object must not close another
        report = _dup_above(report, 64)
        placed = _place(fds)
        keep = {0, 1, 2, LISTEN_FD, READY_FD, placed["secrets"], report}
        for fd in _open_fds():
            if fd not in keep:
                with contextlib.suppress(OSError):  # the listing's own, closed already
                    os.close(fd)
        with os.fdopen(placed["secrets"], "rb") as fh:
            secret_env: dict[str, str] = json.loads(fh.read() or b"{}")
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(secret_env)
        for procs in req.get("cgroups", ()):
            try:
                with open(procs, "w") as fh:
                    fh.write("0")
            except OSError as exc:
                print(f"gateway left in the template's cgroup ({procs}): {exc}", file=sys.stderr)
        argv: list[str] = req["argv"]
        set_cmdline(argv)
        os.write(report, json.dumps({"pid": os.getpid()}).encode())
        os.close(report)
        report = -1
        from agentbox.gateway.__main__ import main

        main(argv[3:])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        if report >= 0:
            os.write(report, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        else:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _open_fds() -> list[int]:
    """This process's open descriptors (read before any is closed)."""
    return [int(n) for n in os.listdir("/proc/self/fd") if n.isdigit()]  # noqa: PTH208


def main() -> None:
    """``python -m agentbox.gateway._template --fd N``: prepare, say ready, serve."""
    if len(sys.argv) != 3 or sys.argv[1] != "--fd" or not sys.argv[2].isdigit():
        print("usage: python -m agentbox.gateway._template --fd N", file=sys.stderr)
        sys.exit(2)
    sock = socket.socket(fileno=int(sys.argv[2]))
    sock.set_inheritable(False)
    prepare()
    sock.send(b"ready")
    serve(sock)


if __name__ == "__main__":
    main()
