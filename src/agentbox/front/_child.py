"""The command's side of a fork: become the caller's ``agentbox`` process, then run it.

:func:`become` runs in a fresh fork of the server (:mod:`agentbox.front.server`)
and turns it, step by step, into the process the caller would have started: its
cgroups, scheduling, limits, umask and signals (from ``/proc``, via
:func:`agentbox.front._peer.posture_of`), then its standard streams, working
directory, environment and argv (from the request). Anything it cannot take on is
a decline, before the command has done anything: the client then runs the command
itself. Only then does it run :func:`agentbox.cli.entry`, which ends the process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from agentbox.front._wire import RequestError
from agentbox.linux.libc import libc as load_libc

#: The most argv entries and environment variables a request may carry.
MAX_ITEMS = 100_000


@dataclass
class Request:
    """A client's request, checked for shape (its content is the caller's own)."""

    argv: list[str]
    env: dict[str, str]
    package: str
    executable: str
    stdio: dict[str, list[str] | None]
    present: list[bool]
    ignored: list[int]
    main_package: str | None  # ``python -m agentbox``: how click names the program
    title: str  # the caller's command line, for ps
    python: dict[str, Any]  # the caller's interpreter configuration (client.python_config)
    path0: str  # its sys.path[0]: the script's directory, or the cwd of python -m
    fds: list[int]  # the caller's open stdio descriptors, then its working directory

    @classmethod
    def parse(cls, doc: dict[str, Any], fds: list[int]) -> Request:
        try:
            return cls._parse(doc, fds)
        except RequestError:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise

    @classmethod
    def _parse(cls, doc: dict[str, Any], fds: list[int]) -> Request:
        if doc.get("v") != 1:
            raise RequestError("an unknown request version")
        argv, env = doc.get("argv"), doc.get("env")
        if not (isinstance(argv, list) and 0 < len(argv) <= MAX_ITEMS):
            raise RequestError("argv is not a list of strings")
        if not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise RequestError("argv is not a list of strings")
        if not (isinstance(env, dict) and len(env) <= MAX_ITEMS):
            raise RequestError("env is not a map of strings")
        for k, v in env.items():
            if not (isinstance(v, str) and k and "=" not in k and "\0" not in k + v):
                raise RequestError("env is not a map of strings")
        package, executable = doc.get("package"), doc.get("executable")
        if not (isinstance(package, str) and isinstance(executable, str)):
            raise RequestError("package and executable must be strings")
        present = doc.get("fds")
        if not (isinstance(present, list) and len(present) == 3):
            raise RequestError("fds must say which of stdin, stdout, stderr are open")
        if not all(isinstance(p, bool) for p in present):
            raise RequestError("fds must say which of stdin, stdout, stderr are open")
        if len(fds) != sum(present) + 1:
            raise RequestError("the descriptors sent do not match the request")
        stdio = doc.get("stdio")
        if not isinstance(stdio, dict):
            raise RequestError("stdio is not a map")
        for name in ("stdin", "stdout", "stderr"):
            spec = stdio.get(name)
            if spec is not None and not (
                isinstance(spec, list) and len(spec) == 2 and all(isinstance(s, str) for s in spec)
            ):
                raise RequestError(f"stdio.{name} is not [encoding, errors]")
        ignored = doc.get("ignored")
        if not (isinstance(ignored, list) and all(isinstance(s, int) for s in ignored)):
            raise RequestError("ignored is not a list of signal numbers")
        valid = {int(s) for s in signal.valid_signals()} - {signal.SIGKILL, signal.SIGSTOP}
        if not set(ignored) <= valid:
            raise RequestError("ignored names a signal that cannot be ignored")
        main_package, title = doc.get("main_package"), doc.get("title")
        if not (main_package is None or isinstance(main_package, str)):
            raise RequestError("main_package is not a string")
        if not (isinstance(title, str) and "\0" not in title):
            raise RequestError("title is not a string")
        python, path0 = doc.get("python"), doc.get("path0")
        if not isinstance(python, dict):
            raise RequestError("python is not a map")
        if not (isinstance(path0, str) and "\0" not in path0):
            raise RequestError("path0 is not a string")
        return cls(
            argv, env, package, executable, stdio, present, ignored, main_package, title,
            python, path0, fds,
        )  # fmt: skip

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def become(
    req: Request,
    posture: dict[str, Any],
    conn: socket.socket,
    ready: int,
    go: int,
    data_dir: Path,
    channel: socket.socket | None = None,
    *,
    end: int | None = None,
) -> NoReturn:
    """Turn this fork into the caller's command, say so on ``ready``, and once the waiter
    says go on ``go``, run it (never returns). The caller's connection stays the
    waiter's: it is closed here (detached first, so that no socket object of this
    process can close a descriptor number reused later)."""
    conn.detach()
    gc.enable()  # the server's objects stay frozen (agentbox.front.server.main)
    try:
        # The server's gateway template: each fork request carries what a gateway this
        # process exec'd would inherit from it (the caller's mount namespace, nice value,
        # affinity, OOM score adjustment, limits, umask, taken on below), and the template's
        # child takes that on (agentbox.gateway._template._take_on), or the template
        # refuses what is more than its own and this process execs the gateway.
        keep: tuple[int, ...] = (ready, go)
        if channel is not None:
            keep += (channel.fileno(),)
        if end is not None:
            keep += (end,)
        os.setpgid(0, 0)  # a group of its own: a kill of the server's group is not the caller's
        _signals(req, posture)
        _join_mounts(posture["pid"])
        _enter_cgroups(posture["cgroups"])
        _schedule(posture)
        _stdio_and_cwd(req, keep=keep)  # the caller's connection is the waiter's
        if channel is not None:
            from agentbox.gateway import adopt_channel

            adopt_channel(channel)
        os.environ.clear()
        os.environ.update(req.env)
        time.tzset()
        _locale(req.python.get("encoding"))
        sys.argv = list(req.argv)
        _as_main(req)
        _fresh_streams(req)
        _fresh_consoles()
        _check_settings(data_dir)
        if end is not None:  # the waiter hears the status before the teardown
            from agentbox.core.exit import announce_exit_to

            announce_exit_to(end)
    except Exception as exc:
        with contextlib.suppress(OSError):
            os.write(ready, f"cannot become the caller's process: {exc}"[:4000].encode())
        os._exit(0)
    os.write(ready, b"ok")
    os.close(ready)
    # Nothing of the command runs until the waiter has told the client it started (the
    # client runs a declined command itself: it must never run twice).
    said = os.read(go, 1)
    os.close(go)
    if said != b"g":
        os._exit(0)
    _run_as_main()


def _run_as_main() -> NoReturn:
    """:func:`agentbox.cli.entry` (which ends the process), and what Python itself does
    with an exception that escapes it: the traceback, then exit 1, or for a Ctrl-C,
    death by SIGINT."""
    import traceback

    from agentbox.cli import entry

    try:
        entry()
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def _locale(theirs: object) -> None:
    """LC_CTYPE from the caller's environment, as Python sets it at its start; the
    default encoding of ``open()`` must then be the caller's (a caller in UTF-8 mode
    has a C.UTF-8 LC_CTYPE in its environment, PEP 538)."""
    import locale

    from agentbox.front.client import text_encoding

    with contextlib.suppress(locale.Error):
        locale.setlocale(locale.LC_CTYPE, "")
    if text_encoding() != theirs:
        raise ValueError(f"the caller's text encoding is {theirs}, here {text_encoding()}")


def _signals(req: Request, posture: dict[str, Any]) -> None:
    """Dispositions as a Python process started by the caller has them, and its mask."""
    ignored = set(req.ignored)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in ignored or sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these
            want: Any = signal.SIG_IGN
        elif sig == signal.SIGINT:
            want = signal.default_int_handler
        else:
            want = signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, want)
    blocked = posture["blocked"]
    mask = {s for s in signal.valid_signals() if blocked >> (int(s) - 1) & 1}
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _join_mounts(pid: int) -> None:
    """Into the caller's mount namespace when it is not the server's (``setns``: this
    process is single-threaded here), so that its paths are the caller's; then the
    root directory must be the caller's too."""
    mine, theirs = Path("/proc/self/ns/mnt"), Path(f"/proc/{pid}/ns/mnt")
    if mine.readlink() == theirs.readlink():
        return
    import ctypes

    libc = load_libc()
    fd = os.open(theirs, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
            err = ctypes.get_errno()
            raise OSError(err, f"cannot join the caller's mount namespace: {os.strerror(err)}")
    finally:
        os.close(fd)
    here, there = Path("/").stat(), Path(f"/proc/{pid}/root/").stat()
    if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
        raise OSError("the caller's root directory is not its mount namespace's root")


def _enter_cgroups(theirs: dict[str, str]) -> None:
    """Into the caller's cgroup in every hierarchy (its unit, its limits, its accounting)."""
    from agentbox.linux.cgroups import cgroup_mounts, cgroups_of

    mounts = cgroup_mounts()
    mine = cgroups_of("self")
    for key, path in theirs.items():
        if mine.get(key) == path:
            continue
        root = mounts.get(key)
        if root is None:
            raise OSError(f"no mount for the cgroup hierarchy {key}")
        procs = root / path.lstrip("/") / "cgroup.procs"
        procs.write_text(f"{os.getpid()}\n")


def _schedule(posture: dict[str, Any]) -> None:
    from agentbox.linux.inherit import take_on

    take_on(nice=posture["nice"], affinity=posture["affinity"],
            oom_score_adj=int(posture["oom_score_adj"]), limits=posture["limits"],
            umask=posture["umask"])  # fmt: skip


def _stdio_and_cwd(req: Request, *, keep: tuple[int, ...]) -> None:
    """The caller's descriptors as 0-2 (a closed one closed), its working directory, and
    nothing else of the server's open."""
    fds = iter(req.fds)
    for target, present in zip((0, 1, 2), req.present, strict=True):
        if present:
            src = next(fds)
            os.dup2(src, target, inheritable=True)
        else:
            with contextlib.suppress(OSError):
                os.close(target)
    cwd = next(fds)
    os.fchdir(cwd)
    high = max(keep)
    for fd in range(3, high + 1):
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.closerange(high + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _as_main(req: Request) -> None:
    """``__main__``, ``sys.executable`` and ``sys.path[0]`` as the caller's (click names
    the program from ``__main__.__package__``: ``python -m agentbox`` or the script's
    name; the gateway is started with ``sys.executable``), and the caller's command line as
    this process's title (``ps``, ``pgrep -f``, ``/proc/<pid>/cmdline``)."""
    import types

    from setproctitle import setproctitle

    sys.executable = req.executable  # the same interpreter (checked), as the caller names it
    if sys.path:
        sys.path[0] = req.path0  # where a later import looks first, as in the caller
    main = types.ModuleType("__main__")
    main.__package__ = req.main_package
    main.__file__ = req.argv[0]
    sys.modules["__main__"] = main
    setproctitle(req.title[:4096])


def _fresh_streams(req: Request) -> None:
    """``sys.stdin``/``stdout``/``stderr`` for the new descriptors, as Python opens them:
    the caller's encodings, stdout line-buffered on a terminal, stderr always."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        spec = req.stdio.get(name)
        if not req.present[fd] or spec is None:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        encoding, errors = spec
        stream = open(  # noqa: SIM115 - the process's own stream, open for its life
            fd,
            "r" if fd == 0 else "w",
            encoding=encoding,
            errors=errors,
            closefd=False,
            buffering=-1,
        )
        if fd:
            stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_consoles() -> None:
    """Consoles made when the server imported their modules decided colour and width
    for the server's streams: made again for the caller's (:mod:`agentbox.core.console`)."""
    from agentbox.core.console import remake_all

    remake_all()


#: The caller's settings as :func:`_check_settings` loaded them (None until then): the
#: command takes them (``agentbox run``) instead of loading them again.
checked_settings: Any = None


def _check_settings(data_dir: Path) -> None:
    """The caller's settings (its environment, its config file) name this server's data dir."""
    global checked_settings
    from agentbox.config import load_settings

    settings = load_settings()
    if settings.data_dir != data_dir:
        raise ValueError(
            f"the caller's data dir is {settings.data_dir}, this front end's {data_dir}"
        )
    checked_settings = settings
