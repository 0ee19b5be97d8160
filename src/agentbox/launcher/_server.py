"""The launcher's unix-socket API (``agentbox launcher serve``): HTTP/JSON, no network.

Routes and error shapes are in :mod:`agentbox.launcher.api`. Who may talk to it is
decided in three layers, each enough on its own against a local user who is not
in the group ``agentbox``:

1. **The directory.** The socket is bound by us, not by uvicorn (which would
   chmod it 0666 after listening), at ``<data_dir>/run/launcher.sock``, inside a
   directory made ``root:agentbox 0750`` *before* the bind (``0700`` when the
   group does not exist). The socket itself is 0660 root:agentbox from birth
   (bound under umask 0177, chowned before ``listen()``), and uvicorn is handed
   the listening socket. There is no instant at which a non-member can connect.
   ``<data_dir>/launcher.sock`` is a symlink to it: the stable path clients use
   (following it still needs the right to enter ``run/``).
2. **The peer.** Every accepted connection's credentials are read from the
   kernel (``SO_PEERCRED``, and ``SO_PEERGROUPS`` for the supplementary groups:
   what the peer held when it called ``connect()``) in ``connection_made``,
   before the HTTP parser exists. Root, the launcher's own uid, or a member of
   ``agentbox`` get an HTTP protocol; anything else is aborted without a byte.
   This is done by :class:`PeerCheckedProtocol`, a wrapper around uvicorn's h11
   protocol passed as ``uvicorn.Config(http=...)``.
3. **The caller's uid** travels with every request (the ASGI ``state``) into
   the :class:`~agentbox.launcher.Launcher` calls: a non-root caller sees, reads
   and cancels only the tasks it submitted, and may delegate only a repo it
   owns; root sees all.

One launcher per data dir: ``run/launcher.lock`` is ``flock``-ed for the
server's life. A second ``launcher serve`` refuses to start (naming the pid that
holds it) before touching anything; a socket left by a killed launcher is
replaced only when the lock is ours and nothing answers on it, and on the way
out only our own socket (same inode) and our own link are removed.

Bodies are parsed with the strict wire schema; the launcher re-validates
everything. Blocking launcher calls run in worker threads so one slow git
command does not stall other clients.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentbox.core.log import get_logger
from agentbox.core.paths import validate_task_id
from agentbox.errors import (
    AgentboxError,
    ConfigError,
    PathRefused,
    RefusedError,
    TaskError,
    TaskNotFound,
)
from agentbox.launcher._boxes import BoxKeeper
from agentbox.launcher._core import Launcher, StopMode
from agentbox.launcher._front import FrontKeeper, start_front
from agentbox.launcher._peer import (
    PEER_KEY,
    PeerCheckedProtocol,
    group_gid,
)
from agentbox.launcher._pool import PoolKeeper, start_pool
from agentbox.launcher._workspace import ensure_private_dir
from agentbox.launcher.api import ModelList, TaskList, TaskRequest
from agentbox.launcher.attempts import PICK_RULES
from agentbox.launcher.pushapi import PushRequest
from agentbox.linux.peer import Peer

log = get_logger(__name__)

#: The socket's directory under the data dir (root:agentbox 0750) and its name there.
RUN_DIR = "run"
SOCKET_NAME = "launcher.sock"
#: The stable client path ``<data_dir>/launcher.sock``: a symlink to ``run/launcher.sock``.
LINK_NAME = "launcher.sock"
LOCK_NAME = "launcher.lock"
#: Request bodies are small; anything bigger is refused before parsing.
MAX_BODY = 256 * 1024


def socket_path(data_dir: Path) -> Path:
    """Where the launcher listens: ``<data_dir>/run/launcher.sock`` (clients may use the
    link ``<data_dir>/launcher.sock``)."""
    return data_dir / RUN_DIR / SOCKET_NAME


_group_gid = group_gid


# -- the app -----------------------------------------------------------------------------


def _error(status: int, exc: BaseException | str, name: str | None = None) -> JSONResponse:
    cls = name or (type(exc).__name__ if isinstance(exc, BaseException) else "AgentboxError")
    return JSONResponse({"error": cls, "message": str(exc)[:4000]}, status_code=status)


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


Handler = Callable[[Request], Awaitable[Response]]
#: A route body: the request and the checked caller's uid.
Endpoint = Callable[[Request, int], Awaitable[Response]]


def _guard(fn: Endpoint) -> Handler:
    async def wrapped(request: Request) -> Response:
        peer = request.scope.get("state", {}).get(PEER_KEY)
        if not isinstance(peer, Peer):
            # Served without PeerCheckedProtocol: nobody is trusted, not even root.
            return _error(403, "this connection was not peer-checked", "RefusedError")
        try:
            return await fn(request, peer.uid)
        except TaskNotFound as exc:
            return _error(404, exc)
        except (RefusedError, ConfigError) as exc:
            return _error(400, exc)
        except TaskError as exc:
            return _error(409 if "not finished" in str(exc) else 500, exc)
        except AgentboxError as exc:
            log.error("request failed", path=request.url.path, error=str(exc))
            return _error(500, exc)

    return wrapped


def create_app(launcher: Launcher, boxes: BoxKeeper | None = None) -> Starlette:
    """The Starlette app serving ``launcher`` (and the SDK's sandboxes of ``boxes``); it
    answers only peer-checked connections (serve it with :func:`build_server`)."""

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    def task_id(request: Request) -> str:
        return validate_task_id(request.path_params["task_id"])

    async def submit(request: Request, caller: int) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, "request body too large", "RefusedError")
        try:
            req = TaskRequest.model_validate_json(body)
        except ValidationError as exc:
            return _error(422, f"invalid task request: {exc}", "RefusedError")
        return _json(await run(launcher.submit, req, caller=caller), 201)

    async def list_tasks(request: Request, caller: int) -> Response:
        return _json(TaskList(tasks=await run(launcher.list, caller=caller)))

    async def get_task(request: Request, caller: int) -> Response:
        return _json(await run(launcher.get, task_id(request), caller=caller))

    async def cancel(request: Request, caller: int) -> Response:
        return _json(await run(launcher.cancel, task_id(request), caller=caller))

    async def result(request: Request, caller: int) -> Response:
        return _json(await run(launcher.result, task_id(request), caller=caller))

    async def publish(request: Request, caller: int) -> Response:
        tid = task_id(request)
        await run(launcher.get, tid, caller=caller)  # another user's task: 404, as unknown
        return _json(await run(launcher.publish, tid))

    async def push(request: Request, caller: int) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, "request body too large", "RefusedError")
        try:
            req = PushRequest.model_validate_json(body or b"{}")
        except ValidationError as exc:
            return _error(422, f"invalid push request: {exc}", "RefusedError")
        # Another user's task: 404, as unknown. The forge token: the submitter's secret.
        return _json(await run(launcher.push, task_id(request), req, caller=caller, env={}))

    async def models(request: Request, caller: int) -> Response:
        return _json(ModelList(models=await run(launcher.models)))

    async def transcript(request: Request, caller: int) -> Response:
        try:
            since = int(request.query_params.get("since", "0")[:12])
            limit = int(request.query_params.get("limit", "200")[:12])
        except ValueError:
            return _error(400, "since and limit must be integers", "RefusedError")
        page = await run(launcher.transcript, task_id(request), since=since, limit=limit,
                         caller=caller)  # fmt: skip
        return _json(page)

    async def submit_group(request: Request, caller: int) -> Response:
        from agentbox.launcher.api import GroupRequest

        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, "request body too large", "RefusedError")
        try:
            req = GroupRequest.model_validate_json(body)
        except ValidationError as exc:
            return _error(422, f"invalid group request: {exc}", "RefusedError")
        infos = await run(launcher.submit_group, req.request, req.attempts, caller=caller,
                          budget_split=req.budget_split)  # fmt: skip
        return _json(TaskList(tasks=infos), 201)

    async def get_group(request: Request, caller: int) -> Response:
        gid = validate_task_id(request.path_params["group"])
        by = request.query_params.get("by", "tests")[:16]
        if by not in PICK_RULES:
            return _error(400, f"by must be one of {', '.join(PICK_RULES)}", "RefusedError")
        return _json(await run(launcher.group_view, gid, by=by, caller=caller))

    async def publish_group(request: Request, caller: int) -> Response:
        gid = validate_task_id(request.path_params["group"])
        raw = request.query_params.get("pick")
        if raw is None:
            k = (await run(launcher.group_view, gid, caller=caller)).pick
            if k is None:
                return _error(409, "no attempt qualifies: choose one with ?pick=K", "TaskError")
        elif raw.isdigit() and 1 <= int(raw) <= 8:
            k = int(raw)
        else:
            return _error(400, "pick must be 1..8", "RefusedError")
        return _json(await run(launcher.publish_pick, gid, k, caller=caller))

    routes = [
        Route("/v1/tasks", _guard(submit), methods=["POST"]),
        Route("/v1/tasks", _guard(list_tasks), methods=["GET"]),
        Route("/v1/tasks/{task_id}", _guard(get_task), methods=["GET"]),
        Route("/v1/tasks/{task_id}/cancel", _guard(cancel), methods=["POST"]),
        Route("/v1/tasks/{task_id}/result", _guard(result), methods=["GET"]),
        Route("/v1/tasks/{task_id}/publish", _guard(publish), methods=["POST"]),
        Route("/v1/tasks/{task_id}/push", _guard(push), methods=["POST"]),
        Route("/v1/tasks/{task_id}/transcript", _guard(transcript), methods=["GET"]),
        Route("/v1/groups", _guard(submit_group), methods=["POST"]),
        Route("/v1/groups/{group}", _guard(get_group), methods=["GET"]),
        Route("/v1/groups/{group}/publish", _guard(publish_group), methods=["POST"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
    ]
    if boxes is not None:
        from agentbox.launcher._boxroutes import box_routes

        routes += box_routes(boxes, _guard, _error, _json, MAX_BODY)
    from agentbox.launcher._secretroutes import secret_routes

    routes += secret_routes(launcher.settings, _guard, _json)
    return Starlette(routes=routes)


def build_server(launcher: Launcher, boxes: BoxKeeper | None = None) -> uvicorn.Server:
    """A uvicorn server for ``launcher`` whose every connection is peer-checked; run it
    with ``server.run(sockets=[bind_socket(path)])``."""
    config = uvicorn.Config(
        create_app(launcher, boxes),
        http=PeerCheckedProtocol,
        loop="asyncio",  # the transports the peer check was written and tested against
        log_level="warning",
        lifespan="off",
        access_log=False,
    )
    return uvicorn.Server(config)


# -- the socket, its directory and the lock ----------------------------------------------


def _prepare_run_dir(run_dir: Path) -> None:
    """``run_dir`` as root:agentbox 0750 (0700 without the group), never through a link."""
    gid = _group_gid()
    ensure_private_dir(run_dir, 0o700)  # closed while its group is set
    os.chown(run_dir, os.geteuid(), os.getegid() if gid is None else gid, follow_symlinks=False)
    run_dir.chmod(0o700 if gid is None else 0o750)


def bind_socket(path: Path, *, backlog: int = 128) -> socket.socket:
    """Bind and listen on ``path`` with its mode and group already final (0660, agentbox).

    The directory is prepared first (see :func:`_prepare_run_dir`); ``path`` must not
    exist. Returns the listening socket, to be handed to the server.
    """
    _prepare_run_dir(path.parent)
    gid = _group_gid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # born 0600: nobody else can connect before the chown
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chown(path, os.geteuid(), -1 if gid is None else gid, follow_symlinks=False)
        path.chmod(0o660)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise PathRefused(
            f"cannot listen on the launcher socket ({exc.strerror})", path=path
        ) from exc
    return sock


class InstanceLock:
    """An ``flock`` on ``run/launcher.lock`` held for the server's life: one launcher per data dir.

    The lock file is never unlinked (unlinking a lock file lets a second locker lock a
    new inode while the first still holds the old one); the kernel drops the lock
    when the process dies, however it dies.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RefusedError(
                f"a launcher is already serving this data dir (pid {holder}, lock {path}); "
                "stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock; idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def _clear_stale(path: Path) -> None:
    """Remove a socket nobody listens on; refuse a live one or anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise PathRefused("refusing to replace a non-socket at the launcher socket", path=path)
    if _answers(path):
        raise RefusedError(
            f"something already listens on {path} (a launcher of an older version?); "
            "not replacing a live socket"
        )
    log.warning("removing a stale launcher socket", path=str(path))
    path.unlink()


def _publish_link(link: Path, target: Path) -> None:
    """``link`` -> ``target`` (relative), atomically; an older version's socket there goes."""
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISLNK(st.st_mode):
        _clear_stale(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(target, link.parent))
    tmp.replace(link)


def _remove_if_ours(path: Path, ident: tuple[int, int] | None) -> None:
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if ident is not None and (st.st_dev, st.st_ino) == ident:
            path.unlink()


def serve(
    launcher: Launcher,
    *,
    path: Path | None = None,
    on_listening: Callable[[Path], None] | None = None,
) -> None:
    """Lock, reconcile, then serve ``launcher`` on its unix socket until told to stop.

    How it stops is said by the signal (:data:`STOP_SIGNALS`, what ``agentbox launcher
    stop`` sends): SIGTERM or SIGINT leave running detached tasks to the next launcher
    (which re-adopts them) and queued ones queued; SIGUSR1 drains (no new task; it
    serves until every queued and running task ended); SIGUSR2 cancels and collects
    every task. A crash (SIGKILL) is a ``leave`` too.

    :class:`~agentbox.errors.RefusedError` if another launcher serves this data dir.
    ``on_listening(path)`` runs once the socket is bound and listening (never before:
    a caller that announces the socket must not announce one that may yet fail).
    """
    data_dir = launcher.settings.data_dir
    path = path or socket_path(data_dir)
    link = data_dir / LINK_NAME if path == socket_path(data_dir) else None
    try:
        _prepare_run_dir(path.parent)
        lock = InstanceLock(path.parent / LOCK_NAME)
    except BaseException:
        launcher.close(wait=False)
        raise
    sock_id: tuple[int, int] | None = None
    keeper: PoolKeeper | None = None
    boxes: BoxKeeper | None = None
    front: FrontKeeper | None = None
    sweeper: Sweeper | None = None
    link_id: tuple[int, int] | None = None
    mode: list[StopMode] = ["leave"]
    try:
        if link is not None and link.is_socket() and not link.is_symlink():
            _clear_stale(link)  # an older version's socket: refused while it answers
        settled = launcher.reconcile()
        if settled:
            log.warning("reconciled tasks of a previous launcher", tasks=settled)
        keeper = start_pool(launcher.settings)  # after the orphan sweep: a warm pool
        sweeper = Sweeper(launcher).start()  # and again every SWEEP_EVERY seconds
        _clear_stale(path)
        listener = bind_socket(path)
        st = os.lstat(path)
        sock_id = (st.st_dev, st.st_ino)
        if link is not None:
            _publish_link(link, path)
            lst = os.lstat(link)
            link_id = (lst.st_dev, lst.st_ino)
            front = start_front(data_dir, path.parent)  # `agentbox` commands, forked
        log.info("launcher serving", socket=str(path), pid=os.getpid())
        if on_listening is not None:
            on_listening(path)
        boxes = BoxKeeper(launcher.settings)  # the SDK's sandboxes (agentbox.sdk)
        server = build_server(launcher, boxes)
        # uvicorn re-raises SIGTERM once it has shut down; make that an exit that
        # runs the clean-up below instead of the default kill.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        _stop_on_signals(launcher, server, mode)
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[listener])
    finally:
        # Only what this launcher made: the lock guarantees nobody replaced them.
        if link is not None:
            _remove_if_ours(link, link_id)
        _remove_if_ours(path, sock_id)
        # Left (re-adopted by the next launcher), drained or cancelled: as told.
        try:
            if sweeper is not None:
                sweeper.stop()
            if front is not None:
                front.stop()
            if boxes is not None:
                boxes.stop()  # the SDK's sandboxes end with the launcher that holds them
            if keeper is not None:
                keeper.stop()  # unclaimed pooled sandboxes removed; claimed ones are tasks
            launcher.stop(mode[0])
        finally:
            lock.release()


#: Seconds between two orphan sweeps of a running service (``reconcile``: the tasks of
#: a launcher that died taken over, orphan sandboxes and gateways removed). A foreground
#: ``agentbox run`` leaves its own sweep to the service when one answers
#: (:mod:`agentbox.cli._run`): on a task's path its podman and docker listings compete
#: with the agent's start for the cores.
SWEEP_EVERY = 60.0
#: The sweeps' nice value (the thread's own; the listings it starts inherit it).
SWEEP_NICE = 10


class Sweeper:
    """The service's orphan sweep every :data:`SWEEP_EVERY` seconds, on a thread of its
    own at :data:`SWEEP_NICE`; a sweep that fails is logged and the next one comes."""

    def __init__(self, launcher: Launcher, every: float = SWEEP_EVERY) -> None:
        self.launcher, self.every = launcher, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentbox-sweep", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(
                os.PRIO_PROCESS, tid, max(SWEEP_NICE, os.getpriority(os.PRIO_PROCESS, tid))
            )
        while not self._stop.wait(self.every):
            if self.launcher.draining:
                continue
            try:
                settled = self.launcher.reconcile()
            except Exception as exc:  # housekeeping: the next sweep tries again
                log.warning("orphan sweep failed", error=str(exc)[-500:])
                continue
            if settled:
                log.warning("reconciled tasks of a launcher that died", tasks=settled)

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


#: The signal ``agentbox launcher stop`` sends for each way of stopping.
STOP_SIGNALS: dict[StopMode, signal.Signals] = {
    "leave": signal.SIGTERM,
    "drain": signal.SIGUSR1,
    "cancel": signal.SIGUSR2,
}


def _stop_on_signals(launcher: Launcher, server: uvicorn.Server, mode: list[StopMode]) -> None:
    """SIGUSR1: drain, then exit; SIGUSR2: exit, cancelling every task (``mode[0]`` says)."""

    def drain_then_exit() -> None:
        launcher.stop("drain")
        server.should_exit = True

    def handler(signum: int, _frame: object) -> None:
        mode[0] = "drain" if signum == signal.SIGUSR1 else "cancel"
        launcher.draining = True  # from now on, submit is refused
        log.warning("launcher stopping", mode=mode[0])
        if mode[0] == "drain":
            threading.Thread(target=drain_then_exit, name="agentbox-drain", daemon=True).start()
        else:
            server.should_exit = True

    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGUSR2, handler)
