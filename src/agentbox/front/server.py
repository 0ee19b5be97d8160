"""The front end's fork server: ``python -m agentbox.front.server`` (started and kept by
``agentbox launcher serve``, :mod:`agentbox.launcher._front`).

One process imports what commands use (:data:`PRELOAD`), builds their click commands
(:data:`PREBUILT`), once, and never runs any of it: no settings loaded, no logging
configured, no thread started. It then forks, ahead of any connection, a *waiter*
(:func:`_waiter_pair`) that forks its *command* ahead too: the command takes the next
connection from the socket (:func:`_take`: the server then forks the next pair),
reads the request, checks the caller (:mod:`agentbox.front._peer`) and the code
(:func:`_stale`), hands the connection to its waiter and becomes the caller's
command (:mod:`agentbox.front._child`); the waiter tells the client its pid, waits
for it and reports how it ended (:func:`_report`). No fork is left on a command's
start. The server itself only forks: a bad request, a slow client or a crash costs
a pair, never the server.

The server exits when its parent (the launcher service) exits, when told to
(SIGTERM), or when a waiter finds that a module it imported changed on disk since
(an upgrade, an edit): the keeper starts a fresh one, and the command that found it
runs in its caller's process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from agentbox.front._peer import own_rights, pinned_peer, posture_of, same_rights
from agentbox.front._wire import RequestError, WireError, recv_request, send_message
from agentbox.front.client import python_config

__all__ = ["PRELOAD", "main"]

#: What ``agentbox run`` (and the commands around it) import, measured on a run.
PRELOAD = (
    "agentbox.cli",
    "agentbox.cli._run",
    "agentbox.cli._tasks",
    "agentbox.cli._wait",
    "agentbox.cli._diff",
    "agentbox.cli._publish",
    "agentbox.cli._launcher",
    "agentbox.cli._client",
    "agentbox.cli._follow",
    "agentbox.cli._logs",
    "agentbox.cli._view",
    "agentbox.cli._env",
    "agentbox.core.log",
    "agentbox.cli.reap",
    "agentbox.config",
    "agentbox.boxfile",
    "agentbox.launcher",
    "agentbox.launcher._core",
    "agentbox.backends",
    "agentbox.backends.podman",
    "agentbox.backends.docker",  # the orphan sweep lists every backend's sandboxes
    "agentbox.backends.microvm.qemu",
    "agentbox.backends.microvm.firecracker",
    "agentbox.backends.fake",
    "agentbox.collect",
    "agentbox.collect.report",
    "agentbox.env",
    "agentbox.front._child",
    "setproctitle",
    "ctypes",
    "http.client",
    "rich._emoji_codes",
    "typer._adapters",
    "typer._click.decorators",
)

#: The commands whose click command, options and type conversions are built here, once
#: (:func:`agentbox.cli.prebuild`): the preloaded modules' commands, and the root's.
PREBUILT = (
    "run", "resume", "tasks", "show", "cancel", "logs", "wait", "watch", "diff", "apply",
    "publish", "launcher", "env",
)  # fmt: skip

#: How long a client may take to send its request.
REQUEST_TIMEOUT = 10.0
#: Seconds before a waiter pair is forked again after one could not be, or ended at once.
PAIR_RETRY = 0.5
#: Seconds after a command took its pair before the next pair is forked, unless a caller
#: is waiting already: past the command's own start (its parse, validation, and for a
#: ``run`` its sandbox's and its agent's start), which the forks would compete with.
PAIR_AFTER = 2.0


def preload(names: tuple[str, ...] = PRELOAD) -> dict[str, tuple[int, int]]:
    """Import ``names``; the (mtime, size) of every agentbox module file now loaded."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional part: the command imports it (or fails) itself
            sys.stderr.write(f"agentbox front end: not preloaded: {name}: {exc}\n")
    _build_models()
    try:
        from agentbox.cli import prebuild

        prebuild(PREBUILT)
    except Exception as exc:  # each command then builds its own, as in its own process
        sys.stderr.write(f"agentbox front end: commands not built ahead: {exc}\n")
    return _files()


def _build_models() -> None:
    """Build the pydantic models whose build is deferred to their first use
    (``defer_build``: a plain process need not pay for models it never validates); a
    fork would otherwise build them again in every command that uses one."""
    from pydantic import BaseModel

    todo: list[type[BaseModel]] = [BaseModel]
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if cls.__module__.startswith("agentbox.") and not cls.__pydantic_complete__:
                with contextlib.suppress(Exception):  # one that cannot build yet: its first use
                    cls.model_rebuild()


def _files() -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "agentbox" or name.startswith("agentbox.")) and path:
            with contextlib.suppress(OSError):
                st = Path(path).stat()
                out[path] = (st.st_mtime_ns, st.st_size)
    return out


def _stale(files: dict[str, tuple[int, int]]) -> str | None:
    """The first loaded module file that changed since it was imported, if any."""
    for path, was in files.items():
        try:
            st = os.stat(path)  # noqa: PTH116 (on every request: 218 files, 2-5 -> 0.8 ms)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != was:
            return path
    return None


class Facts(NamedTuple):
    """The server's own facts a waiter compares a request with, read once at its start
    (nothing the server runs changes them): the preloaded modules' files, its rights,
    its package directory, Python executable and interpreter configuration."""

    files: dict[str, tuple[int, int]]
    rights: dict[str, str]
    package: str
    executable: Path
    python: dict[str, Any]

    @classmethod
    def read(cls, files: dict[str, tuple[int, int]]) -> Facts:
        return cls(
            files=files,
            rights=own_rights(),
            package=os.path.dirname(os.path.realpath(_pkg_file())),  # noqa: PTH120
            executable=Path(sys.executable).resolve(),
            # As the request carries it: through JSON (tuples become lists).
            python={**json.loads(json.dumps(python_config())), "encoding": None},
        )


def _bind(path: Path) -> socket.socket:
    """Listen on ``path``, mode 0600 from birth; a socket left there is replaced (the
    caller holds the data dir's launcher lock: no other server is this dir's)."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m agentbox.front.server")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    parent = os.pidfd_open(args.parent)  # before the imports: a parent gone meanwhile shows
    # Copy-on-write: a collection in a command would write to the header of every object
    # imported here, copying the whole heap into each command. Collect nothing while
    # importing (no holes), then freeze what is here out of every later collection; the
    # command turns collection back on (agentbox.front._child).
    gc.disable()
    facts = Facts.read(preload())
    image = _warm_image(None)
    gc.freeze()
    if threading.active_count() != 1:  # a fork copies only the forking thread
        sys.stderr.write("agentbox front end: an import started a thread; not serving\n")
        os._exit(1)
    # Set once here, before any fork: setproctitle takes over argv's and environ's memory
    # while environ is still the one the kernel laid out (a command's fork sets its own).
    from setproctitle import setproctitle

    setproctitle(f"agentbox front end {args.socket}")
    listener = _bind(args.socket)
    template = _gateway_template()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    me = os.getpid()
    while True:
        # A waiter and its command, forked ahead: the next connection finds them waiting
        # (a fork of this heap is ~4 ms each, no longer on a command's start). Its
        # command takes the connection, says so on ``took``, and the next pair is forked.
        image = _warm_image(image)
        spare = _channel(template)
        took_r, took_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            for fd in (took_r, took_w):
                os.close(fd)
            if spare is not None:
                spare.close()
            time.sleep(PAIR_RETRY)
            continue
        if pid == 0:
            os.close(took_r)
            os.close(parent)
            _waiter_pair(listener, took_w, args.data_dir, facts, me, spare)  # never returns
        os.close(took_w)
        if spare is not None:  # the waiter's now; the next pair gets a new one
            spare.close()
        forked = time.monotonic()
        while True:
            try:
                ready, _, _ = select.select([took_r, parent], [], [])
            except InterruptedError:
                continue
            break
        if parent in ready:
            with contextlib.suppress(OSError):
                args.socket.unlink()
            os._exit(0)
        took = os.read(took_r, 1)
        os.close(took_r)
        if not took and time.monotonic() - forked < PAIR_RETRY:
            time.sleep(PAIR_RETRY)  # a pair that ended at once (no connection taken): no loop
        if took:
            # The next pair once the command that took this one has started (two forks of
            # this heap and their page copies would compete with it for the cores), or at
            # once when the next caller is already waiting.
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select([listener.fileno(), parent], [], [], PAIR_AFTER)
                if parent in ready:
                    with contextlib.suppress(OSError):
                        args.socket.unlink()
                    os._exit(0)


def _warm_image(image: str | None) -> str | None:
    """The sandbox image's facts (``podman image inspect``) read here, for every command
    forked from now on (a fork's own inspect was a podman process on each ``agentbox
    run``'s path): the image the service's settings name, looked up once (``image``:
    as found before), and read again only once podman's image list changed
    (:func:`agentbox.backends.oci._args.image_facts` holds them while it has not)."""
    try:
        from agentbox.backends import warm_image_facts

        if image is None:
            from agentbox.config import load_settings

            image = load_settings().image
        warm_image_facts(image)
    except Exception as exc:  # each command then inspects it itself, as before
        sys.stderr.write(f"agentbox front end: the image's facts not read ahead: {exc}\n")
    return image


def _gateway_template() -> Any:
    """A gateway template for the commands this server forks (a served ``agentbox run``
    forks its task's gateway from it, see :func:`_channel`), or None: turned off
    (``AGENTBOX_GATEWAY_TEMPLATE``), or it would not start (the commands then start
    their own, as without a front end)."""
    if os.environ.get("AGENTBOX_GATEWAY_TEMPLATE", "").strip().lower() in _OFF:
        return None
    try:
        from agentbox.gateway import start_template

        return start_template()
    except Exception as exc:
        sys.stderr.write(f"agentbox front end: no gateway template: {exc}\n")
        return None


def _channel(template: Any) -> socket.socket | None:
    """A channel of its own to the template for the next command (its waiter keeps it
    and the command adopts it), or None."""
    if template is None or not template.alive():
        return None
    try:
        sock: socket.socket = template.channel()
    except Exception as exc:
        sys.stderr.write(f"agentbox front end: no gateway template channel: {exc}\n")
        return None
    return sock


_OFF = ("0", "false", "off", "no", "n", "f")


def _waiter_pair(
    listener: socket.socket,
    took: int,
    data_dir: Path,
    facts: Facts,
    server: int,
    channel: socket.socket | None,
) -> NoReturn:
    """The waiter, forked ahead: it forks its command ahead too, which takes the next
    connection (:func:`_take`); the waiter is then handed the connection and reports
    the command's end (:func:`_report`). Never returns. ``channel``: to the server's
    gateway template, for the command."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 0
    try:
        server_fd = os.pidfd_open(server)
        if os.getppid() != server:  # the server ended before the pidfd pinned it
            os._exit(0)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            mine.close()
            _take(listener, took, server_fd, theirs, data_dir, facts, server, channel)
        theirs.close()
        listener.close()
        os.close(took)
        os.close(server_fd)
        if channel is not None:
            channel.close()  # the command's now
        _report(mine, pid)
    except BaseException:  # a waiter never reaches the server's loop
        code = 1
    os._exit(code)


def _take(
    listener: socket.socket,
    took: int,
    server_fd: int,
    waiter: socket.socket,
    data_dir: Path,
    facts: Facts,
    server: int,
    channel: socket.socket | None,
) -> NoReturn:
    """The command, forked ahead: take the next connection (or end with the server), say
    so on ``took``, then serve it (:func:`_serve`). Never returns."""
    try:
        while True:
            try:
                ready, _, _ = select.select([listener.fileno(), server_fd], [], [])
            except InterruptedError:
                continue
            if server_fd in ready:
                os._exit(0)
            try:
                conn, _ = listener.accept()
            except OSError:  # taken back by its client meanwhile
                continue
            break
        os.write(took, b".")
        os.close(took)
        os.close(server_fd)
        listener.close()
    except BaseException:
        os._exit(1)
    code = 0
    try:
        _serve(conn, data_dir, facts, server, channel, waiter)
    except BaseException as exc:  # never returns to the server's code
        # A command runs only after "started" was sent (its go pipe closes unsaid with
        # this process): before that, the client may run the command itself.
        _decline(conn, f"the front end failed: {type(exc).__name__}: {exc}"[:1000])
        code = 1
    os._exit(code)


def _decline(conn: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        send_message(conn, {"declined": reason})


def _serve(
    conn: socket.socket,
    data_dir: Path,
    facts: Facts,
    server: int,
    channel: socket.socket | None,
    waiter: socket.socket,
) -> None:
    """Check the request; decline it (and return), or hand the waiter the connection and
    become the caller's command (:func:`agentbox.front._child.become`, never returns)."""
    peer = pinned_peer(conn)
    conn.settimeout(REQUEST_TIMEOUT)
    try:
        send_message(conn, {"hello": 1})  # the client sends its descriptors only now
        request, fds = recv_request(conn)
    except (OSError, WireError) as exc:
        _decline(conn, f"bad request: {exc}")
        return
    conn.settimeout(None)
    from agentbox.front._child import Request

    try:
        req = Request.parse(request, fds)
    except RequestError as exc:
        _decline(conn, str(exc))
        return
    why = same_rights(peer, facts.rights)
    if why is None and req.package != facts.package:
        why = f"another agentbox ({req.package})"
    if why is None and Path(req.executable).resolve() != facts.executable:
        why = f"another Python ({req.executable})"
    if why is None and facts.python != {**req.python, "encoding": None}:
        why = "another Python configuration (sys.path, flags, -W or -X options)"
    changed = _stale(facts.files) if why is None else None
    if changed is not None:
        why = f"{changed} changed since the front end started"
        with contextlib.suppress(OSError):
            os.kill(server, signal.SIGTERM)  # its keeper starts a fresh one
    if why is None:
        try:
            posture: dict[str, Any] = posture_of(peer)
        except OSError as exc:
            why = f"cannot read the caller's process ({exc})"
    if why is not None:
        req.close_fds()
        _decline(conn, why)
        return
    assert peer.pidfd is not None  # pinned_peer always pins
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    end_r, end_w = os.pipe2(os.O_CLOEXEC)  # the command's status, told before its teardown
    # The waiter holds the connection from here: it tells the client "started" (or
    # declines, if this process cannot become the command) and reports the end.
    socket.send_fds(waiter, [b"c"], [conn.fileno(), peer.pidfd, ready_r, go_w, end_r])
    for fd in (ready_r, go_w, end_r, waiter.detach()):
        os.close(fd)
    from agentbox.front._child import become

    become(req, posture, conn, ready_w, go_r, data_dir, channel, end=end_w)  # never returns


def _report(command: socket.socket, pid: int) -> None:
    """The waiter's part: once its command took a connection and handed it over, tell
    the client the command started (when it says it is ready), and how it ended."""
    try:
        _, fds, _, _ = socket.recv_fds(command, 1, 5)
    except OSError:
        fds = []
    command.close()
    if len(fds) != 5:  # no connection taken (the server ended), or it was declined
        for fd in fds:
            os.close(fd)
        os.waitpid(pid, 0)
        return
    conn = socket.socket(fileno=fds[0])
    caller, ready_r, go_w, end = fds[1:]
    with os.fdopen(ready_r, "rb") as ready, os.fdopen(go_w, "wb", buffering=0) as go:
        said = ready.read(4096)
        if said == b"ok":
            # "started" first, then go: a command runs only if its client was told it
            # did (a declined or unanswered one the client may run itself).
            send_message(conn, {"started": pid})
            go.write(b"g")
    if said != b"ok":  # it ended, or ends now that go closed unsaid
        os.close(end)
        _decline(conn, said.decode(errors="replace") or "the command could not start")
        os.waitpid(pid, 0)
        return
    told, status = _wait_or_kill(pid, conn, caller, end)
    if told is not None:  # its work done, its output let go: the client may end now
        send_message(conn, {"exit": told})
        os.waitpid(pid, 0)
    elif os.WIFSIGNALED(status):
        send_message(conn, {"signal": os.WTERMSIG(status)})
    else:
        send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})


def _wait_or_kill(pid: int, conn: socket.socket, caller: int, end: int) -> tuple[int | None, int]:
    """The status the command told on ``end`` as it ended (:func:`agentbox.core.exit.
    announce_exit_to`), before the kernel's teardown of it (then its wait status is not
    read here: 0), else its wait status; SIGKILL it first if its caller goes (the
    connection ends, or the caller's pidfd says it exited): a client killed with SIGKILL
    takes its command along, as one process would go. The watch is here, not in the
    command: a command must be as single-threaded as its caller's own process would be.
    ``end`` is closed here."""
    command = os.pidfd_open(pid)
    watch = [command, conn.fileno(), caller, end]
    try:
        while True:
            try:
                ready, _, _ = select.select(watch, [], [])
            except InterruptedError:
                continue
            if end in ready:
                said = os.read(end, 1)
                if said:
                    return said[0], 0
                watch.remove(end)  # closed unsaid (an exec, a death): its wait status
                continue
            if command not in ready:  # the client sends nothing more: it has gone
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(command, signal.SIGKILL)
            return None, os.waitpid(pid, 0)[1]
    finally:
        os.close(command)
        os.close(end)


def _pkg_file() -> str:
    import agentbox

    return agentbox.__file__ or ""


if __name__ == "__main__":
    main()
