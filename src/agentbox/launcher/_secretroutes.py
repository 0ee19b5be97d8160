"""The launcher's ``/v1/secrets`` routes (wire schema: :mod:`agentbox.launcher.secretapi`).

Served behind the same peer check as the task routes: the owner of what is set, listed
or removed is the caller's uid from ``SO_PEERCRED``. A body that does not parse is
refused without echoing it (pydantic's message would quote the value).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import anyio.to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentbox.config import Settings
from agentbox.errors import SecretNotFound
from agentbox.launcher.secretapi import SecretEntry, SecretList, SecretSet
from agentbox.secrets import SecretInfo, SecretStore

Endpoint = Callable[[Request, int], Awaitable[Response]]
Guard = Callable[[Endpoint], Callable[[Request], Awaitable[Response]]]

#: A secret's body is small (a value of at most 8 KiB, JSON-escaped at most 6x).
MAX_BODY = 64 * 1024


def _entry(info: SecretInfo) -> SecretEntry:
    return SecretEntry(**asdict(info))


def _refused(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": "RefusedError", "message": message}, status_code=status)


def secret_routes(
    settings: Settings, guard: Guard, as_json: Callable[[BaseModel, int], Response]
) -> list[Route]:
    """The secret routes on ``settings``' store, wrapped in the server's ``guard``."""
    store = SecretStore(settings)

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    def not_found(fn: Endpoint) -> Endpoint:
        async def wrapped(request: Request, caller: int) -> Response:
            try:
                return await fn(request, caller)
            except SecretNotFound as exc:
                body = {
                    "error": "SecretNotFound",
                    "message": str(exc),
                    "name": exc.name,
                    "uid": exc.uid,
                }
                return JSONResponse(body, status_code=404)

        return wrapped

    async def list_secrets(request: Request, caller: int) -> Response:
        everyone = request.query_params.get("all") in ("1", "true")
        if everyone and caller != 0:
            return _refused(403, "only root lists every user's secrets")
        found = await run(store.list, caller, all_users=everyone)
        return as_json(SecretList(secrets=[_entry(i) for i in found]), 200)

    async def set_secret(request: Request, caller: int) -> Response:
        name = str(request.path_params["name"])
        body = await request.body()
        if len(body) > MAX_BODY:
            return _refused(413, "request body too large")
        try:
            req = SecretSet.model_validate_json(body)
        except ValidationError as exc:
            where = ", ".join(
                ".".join(map(str, e["loc"])) + f": {e['type']}"
                for e in exc.errors(include_input=False)
            )
            return _refused(422, f"invalid secret request ({where})")
        if req.shared and caller != 0:
            return _refused(403, "only root can share a secret")
        info = await run(store.set, name, req.value, caller, shared=req.shared)
        return as_json(_entry(info), 201)

    async def remove_secret(request: Request, caller: int) -> Response:
        name = str(request.path_params["name"])
        return as_json(_entry(await run(store.remove, name, caller)), 200)

    return [
        Route("/v1/secrets", guard(not_found(list_secrets)), methods=["GET"]),
        Route("/v1/secrets/{name}", guard(not_found(set_secret)), methods=["PUT"]),
        Route("/v1/secrets/{name}", guard(not_found(remove_secret)), methods=["DELETE"]),
    ]
