"""The launcher's ``/v1/sandboxes`` routes (wire schema: :mod:`agentbox.launcher.boxapi`).

Served behind the same peer check as the task routes; the caller's uid and pid are
the kernel's (the connection's ``SO_PEERCRED``), never a request field.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio.to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agentbox.errors import AgentboxError, SandboxGone
from agentbox.launcher._boxes import BoxKeeper
from agentbox.launcher._peer import PEER_KEY
from agentbox.launcher.boxapi import (
    MAX_ARCHIVE,
    MAX_FILE,
    ExecEvent,
    ExecRequest,
    FileList,
    ForkRequest,
    SandboxList,
    SandboxRequest,
)
from agentbox.linux.peer import Peer

_SID = re.compile(r"sb-[0-9a-f]{16}")
_EID = re.compile(r"[0-9a-f]{16}")

Endpoint = Callable[[Request, int], Awaitable[Response]]
Guard = Callable[[Endpoint], Callable[[Request], Awaitable[Response]]]
ErrorFn = Callable[..., Response]


def box_routes(keeper: BoxKeeper, guard: Guard, error: ErrorFn, as_json: Callable[..., Response],
               max_body: int) -> list[Route]:  # fmt: skip
    """The sandbox routes for ``keeper``, wrapped in the server's ``guard``."""

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    def pid(request: Request) -> int:
        peer = request.scope["state"][PEER_KEY]
        assert isinstance(peer, Peer)
        return peer.pid

    def sid(request: Request) -> str:
        value = str(request.path_params["sid"])
        if not _SID.fullmatch(value):
            raise SandboxGone(f"no sandbox {value[:40]!r}")
        return value

    def eid(request: Request) -> str:
        value = str(request.path_params["eid"])
        if not _EID.fullmatch(value):
            raise SandboxGone(f"no command {value[:40]!r}")
        return value

    def not_found(fn: Endpoint) -> Endpoint:
        async def wrapped(request: Request, caller: int) -> Response:
            try:
                return await fn(request, caller)
            except SandboxGone as exc:
                return error(404, exc)

        return wrapped

    async def body(request: Request, limit: int) -> bytes | Response:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                return error(413, "request body too large", "RefusedError")
        return bytes(data)

    def parse(model: type[BaseModel], raw: bytes) -> Any:
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            return error(422, f"invalid request: {exc}", "RefusedError")

    async def create(request: Request, caller: int) -> Response:
        raw = await body(request, max_body)
        if isinstance(raw, Response):
            return raw
        req = parse(SandboxRequest, raw)
        if isinstance(req, Response):
            return req
        return as_json(await run(keeper.create, req, caller=caller, pid=pid(request)), 201)

    async def list_(request: Request, caller: int) -> Response:
        found = await run(keeper.list, caller=caller)
        return as_json(SandboxList(sandboxes=found, spare_ready=keeper.spare_ready))

    async def get(request: Request, caller: int) -> Response:
        return as_json(await run(keeper.get, sid(request), caller=caller))

    async def connect(request: Request, caller: int) -> Response:
        return as_json(await run(keeper.connect, sid(request), caller=caller, pid=pid(request)))

    async def fork(request: Request, caller: int) -> Response:
        raw = await body(request, max_body)
        if isinstance(raw, Response):
            return raw
        req = parse(ForkRequest, raw)
        if isinstance(req, Response):
            return req
        made = await run(keeper.fork, sid(request), req.n, req.timeout, caller=caller,
                         pid=pid(request))  # fmt: skip
        return as_json(SandboxList(sandboxes=made), 201)

    async def remove(request: Request, caller: int) -> Response:
        return as_json(await run(keeper.remove, sid(request), caller=caller))

    async def exec_(request: Request, caller: int) -> Response:
        raw = await body(request, MAX_FILE + max_body)
        if isinstance(raw, Response):
            return raw
        req = parse(ExecRequest, raw)
        if isinstance(req, Response):
            return req
        box = sid(request)
        if req.background:
            return as_json(await run(keeper.start, box, req, caller=caller), 201)
        keeper.get(box, caller=caller)  # 404 before the stream starts
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        def emit(ev: ExecEvent | None) -> None:
            line = (
                None if ev is None else ev.model_dump_json(exclude_defaults=True).encode() + b"\n"
            )
            loop.call_soon_threadsafe(queue.put_nowait, line)

        def out(kind: str) -> Callable[[bytes], None]:
            return lambda c: emit(ExecEvent(kind=kind, data=c.decode(errors="replace")))  # type: ignore[arg-type]

        def work() -> None:
            try:
                rc, timed_out = keeper.run(box, req, caller=caller, on_stdout=out("stdout"),
                                           on_stderr=out("stderr"))  # fmt: skip
                emit(ExecEvent(kind="exit", exit_code=rc, timed_out=timed_out))
            except (AgentboxError, OSError) as exc:
                emit(ExecEvent(kind="error", data=f"{type(exc).__name__}: {exc}"[:4000]))
            finally:
                emit(None)

        threading.Thread(target=work, name="agentbox-sdk-exec", daemon=True).start()

        async def lines() -> AsyncIterator[bytes]:
            while (line := await queue.get()) is not None:
                yield line

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def exec_state(request: Request, caller: int) -> Response:
        return as_json(await run(keeper.exec_state, sid(request), eid(request), caller=caller))

    async def kill(request: Request, caller: int) -> Response:
        return as_json(await run(keeper.kill, sid(request), eid(request), caller=caller))

    def path_param(request: Request) -> str:
        return request.query_params.get("path", "")[:4096]

    async def write(request: Request, caller: int) -> Response:
        raw = await body(request, MAX_FILE)
        if isinstance(raw, Response):
            return raw
        return as_json(await run(keeper.write, sid(request), path_param(request), raw,
                                 caller=caller))  # fmt: skip

    async def read(request: Request, caller: int) -> Response:
        data = await run(keeper.read, sid(request), path_param(request), caller=caller)
        return Response(data, media_type="application/octet-stream")

    async def listdir(request: Request, caller: int) -> Response:
        found: FileList = await run(keeper.listdir, sid(request), path_param(request),
                                    caller=caller)  # fmt: skip
        return as_json(found)

    async def upload(request: Request, caller: int) -> Response:
        raw = await body(request, MAX_ARCHIVE)
        if isinstance(raw, Response):
            return raw
        return as_json(await run(keeper.upload, sid(request), path_param(request), raw,
                                 caller=caller))  # fmt: skip

    async def download(request: Request, caller: int) -> Response:
        data = await run(keeper.download, sid(request), path_param(request), caller=caller)
        return Response(data, media_type="application/x-tar")

    def r(path: str, fn: Endpoint, method: str) -> Route:
        return Route(path, guard(not_found(fn)), methods=[method])

    base = "/v1/sandboxes/{sid}"
    return [
        r("/v1/sandboxes", create, "POST"),
        r("/v1/sandboxes", list_, "GET"),
        r(base, get, "GET"),
        r(base, remove, "DELETE"),
        r(f"{base}/connect", connect, "POST"),
        r(f"{base}/fork", fork, "POST"),
        r(f"{base}/exec", exec_, "POST"),
        r(base + "/exec/{eid}", exec_state, "GET"),
        r(base + "/exec/{eid}/kill", kill, "POST"),
        r(f"{base}/files", write, "PUT"),
        r(f"{base}/files", read, "GET"),
        r(f"{base}/dir", listdir, "GET"),
        r(f"{base}/archive", upload, "PUT"),
        r(f"{base}/archive", download, "GET"),
    ]
