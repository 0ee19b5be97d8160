"""The launcher's unix-socket API (``agentbox launcher serve``): HTTP/JSON, no network.

Routes and error shapes are in :mod:`agentbox.launcher.api`. The socket is
``<data_dir>/launcher.sock``, mode 0660, owned by root and by the group
``agentbox`` when that group exists (the MCP server, unprivileged, is put in
it). Bodies are parsed with the strict wire schema; the launcher re-validates
everything. Blocking launcher calls run in worker threads so one slow git
command does not stall other clients.
"""

from __future__ import annotations

import contextlib
import grp
import os
import signal
import stat
import sys
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

from agentbox._log import get_logger
from agentbox.errors import (
    AgentboxError,
    ConfigError,
    PathRefused,
    RefusedError,
    TaskError,
    TaskNotFound,
)
from agentbox.launcher._core import Launcher
from agentbox.launcher.api import ModelList, TaskList, TaskRequest
from agentbox.paths import validate_task_id

__all__ = ["SOCKET_NAME", "create_app", "serve", "socket_path"]

log = get_logger("launcher.server")

SOCKET_NAME = "launcher.sock"
#: Request bodies are small; anything bigger is refused before parsing.
MAX_BODY = 256 * 1024
SOCKET_GROUP = "agentbox"


def socket_path(data_dir: Path) -> Path:
    """Where the launcher listens: ``<data_dir>/launcher.sock``."""
    return data_dir / SOCKET_NAME


def _error(status: int, exc: BaseException | str, name: str | None = None) -> JSONResponse:
    cls = name or (type(exc).__name__ if isinstance(exc, BaseException) else "AgentboxError")
    return JSONResponse({"error": cls, "message": str(exc)[:4000]}, status_code=status)


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


Handler = Callable[[Request], Awaitable[Response]]


def _guard(fn: Callable[[Request], Awaitable[Response]]) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
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


def create_app(launcher: Launcher) -> Starlette:
    """The Starlette app serving ``launcher``."""

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args)

    def task_id(request: Request) -> str:
        return validate_task_id(request.path_params["task_id"])

    async def submit(request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, "request body too large", "RefusedError")
        try:
            req = TaskRequest.model_validate_json(body)
        except ValidationError as exc:
            return _error(422, f"invalid task request: {exc}", "RefusedError")
        return _json(await run(launcher.submit, req), 201)

    async def list_tasks(request: Request) -> Response:
        return _json(TaskList(tasks=await run(launcher.list)))

    async def get_task(request: Request) -> Response:
        return _json(await run(launcher.get, task_id(request)))

    async def cancel(request: Request) -> Response:
        return _json(await run(launcher.cancel, task_id(request)))

    async def result(request: Request) -> Response:
        return _json(await run(launcher.result, task_id(request)))

    async def models(request: Request) -> Response:
        return _json(ModelList(models=await run(launcher.models)))

    routes = [
        Route("/v1/tasks", _guard(submit), methods=["POST"]),
        Route("/v1/tasks", _guard(list_tasks), methods=["GET"]),
        Route("/v1/tasks/{task_id}", _guard(get_task), methods=["GET"]),
        Route("/v1/tasks/{task_id}/cancel", _guard(cancel), methods=["POST"]),
        Route("/v1/tasks/{task_id}/result", _guard(result), methods=["GET"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
    ]
    return Starlette(routes=routes)


def _secure_socket(path: Path) -> None:
    """0660, root-owned, group ``agentbox`` if it exists."""
    gid = -1
    with contextlib.suppress(KeyError):
        gid = grp.getgrnam(SOCKET_GROUP).gr_gid
    os.chown(path, os.geteuid(), gid, follow_symlinks=False)
    path.chmod(0o660)


class _Server(uvicorn.Server):
    """Binds the socket under a tight umask, then restores the umask for everything else."""

    def __init__(self, config: uvicorn.Config, path: Path) -> None:
        super().__init__(config)
        self._path = path

    async def startup(self, sockets: Any = None) -> None:
        old = os.umask(0o117)  # the socket is born 0660, never briefly world-writable
        try:
            await super().startup(sockets)
        finally:
            # Task dirs and workspaces are made with the normal umask.
            os.umask(old)
        _secure_socket(self._path)


def serve(launcher: Launcher, *, path: Path | None = None) -> None:
    """Reconcile, then serve ``launcher`` on its unix socket until SIGINT/SIGTERM."""
    path = path or socket_path(launcher.settings.data_dir)
    settled = launcher.reconcile()
    if settled:
        log.warning("reconciled tasks of a previous launcher", tasks=settled)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise PathRefused("refusing to replace a non-socket at the launcher socket", path=path)
        path.unlink()
    try:
        config = uvicorn.Config(
            create_app(launcher), uds=str(path), log_level="warning", lifespan="off"
        )
        server = _Server(config, path)
        # uvicorn re-raises SIGTERM once it has shut down; make that an exit that
        # runs the clean-up below instead of the default kill.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # Running tasks are cancelled and collected; a crash instead leaves them
        # to the next launcher's reconcile.
        launcher.shutdown()
