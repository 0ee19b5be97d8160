"""The web view's server: a Starlette app on 127.0.0.1 that reads the launcher as its user.

Who may look: whoever opens the login link printed at start (a fresh random token), which
sets a session cookie (``HttpOnly``, ``SameSite=Strict``); every other page needs it. The
``Host`` header must name this loopback address (a DNS-rebinding page cannot), a request
that changes something must come from this origin (``Origin``) and carry the session's
form token. Responses forbid framing, scripts from elsewhere and inline script (CSP).

What it shows: exactly what the launcher answers this process's user over its socket
(the launcher scopes by SO_PEERCRED), so a user sees their own tasks and root all.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from agentbox.core.paths import validate_task_id
from agentbox.core.text import visible
from agentbox.errors import AgentboxError, RefusedError, TaskNotFound
from agentbox.ui import _render as r

COOKIE = "agentbox_ui"
#: How often a live page asks the launcher for news.
POLL = 1.0
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'none'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes a POST's Origin "null"
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_HERE = Path(__file__).parent / "static"
#: The one script and one stylesheet (the CSP allows no inline script or style).
_STATIC = {
    "app.js": ((_HERE / "app.js").read_bytes(), "text/javascript"),
    "style.css": ((_HERE / "style.css").read_bytes(), "text/css"),
}
_STATUSES = ("queued", "running", "collecting", "done", "failed", "timed_out", "cancelled")


class Session:
    """The login token, the session ids it has handed out and their form tokens."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(32)
        self.sessions: dict[str, str] = {}  # session id -> csrf token

    def login(self, token: str) -> str | None:
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return None
        sid = secrets.token_urlsafe(32)
        self.sessions[sid] = secrets.token_urlsafe(24)
        return sid

    def csrf(self, request: Request) -> str | None:
        sid = request.cookies.get(COOKIE, "")
        for known, csrf in self.sessions.items():
            if hmac.compare_digest(sid.encode(), known.encode()):
                return csrf
        return None


Handler = Callable[[Request], Awaitable[Response]]


def make_app(
    client_factory: Callable[[], Any], address: str, who: str, data_dir: Path
) -> tuple[Starlette, Session]:
    """The app for a view at ``address`` (``127.0.0.1:PORT``, what the browser's ``Host``
    must say); ``client_factory()`` makes a launcher client (one per call: it is used
    from worker threads)."""
    session = Session()
    hosts = {address}
    origins = {f"http://{address}"}

    async def call(fn: str, *args: Any, **kw: Any) -> Any:
        def run() -> Any:
            with client_factory() as c:
                return getattr(c, fn)(*args, **kw)

        return await anyio.to_thread.run_sync(run)

    def page(name: str, code: int = 200, **data: Any) -> HTMLResponse:
        return HTMLResponse(r.render(name, who=who, **data), status_code=code)

    def message(title: str, text: str, code: int) -> HTMLResponse:
        return page("message", code, title=title, message=visible(text))

    def guarded(handler: Handler, *, login: bool = False, change: bool = False) -> Handler:
        async def wrapped(request: Request) -> Response:
            if request.headers.get("host", "") not in hosts:
                resp: Response = PlainTextResponse("wrong Host", status_code=403)
            elif change and request.headers.get("origin", "") not in origins:
                resp = PlainTextResponse("cross-origin request refused", status_code=403)
            elif not login and session.csrf(request) is None:
                resp = message(
                    "Not signed in",
                    "Open the login link `agentbox ui` printed when it started.",
                    401,
                )
            else:
                try:
                    resp = await handler(request)
                except TaskNotFound:
                    resp = message("No such task", "No task of yours has that id.", 404)
                except RefusedError as exc:
                    resp = message("Refused", str(exc), 409)
                except AgentboxError as exc:
                    resp = message("Launcher error", str(exc), 502)
            for k, v in _SECURITY_HEADERS.items():
                resp.headers.setdefault(k, v)
            return resp

        return wrapped

    async def login(request: Request) -> Response:
        sid = session.login(request.query_params.get("token", ""))
        if sid is None:
            return message("Not signed in", "That login link is not this view's.", 403)
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, sid, httponly=True, samesite="strict", path="/")
        return resp

    def _listing(tasks: list[Any], status: str, sort: str) -> list[dict[str, Any]]:
        if status:
            tasks = [t for t in tasks if t.status == status]
        key = sort.lstrip("-")
        pick: dict[str, Callable[[Any], Any]] = {
            "created": lambda t: t.created_at,
            "status": lambda t: t.status,
            "tokens": lambda t: t.tokens.total,
            "cost": lambda t: t.tokens.cost_usd or 0.0,
        }
        tasks = sorted(tasks, key=pick.get(key, pick["created"]), reverse=sort.startswith("-"))
        return [r.task_view(t) for t in tasks]

    def _params(request: Request) -> tuple[str, str]:
        status = request.query_params.get("status", "")
        sort = request.query_params.get("sort", "-created")
        return (status if status in _STATUSES else ""), (
            sort if sort in {k for k, _ in r.SORTS} else "-created"
        )

    async def task_list(request: Request) -> Response:
        status, sort = _params(request)
        rows = _listing(await call("list"), status, sort)
        return page("list", tasks=rows, status=status, sort=sort, statuses=_STATUSES,
                    sorts=r.SORTS)  # fmt: skip

    async def list_events(request: Request) -> Response:
        status, sort = _params(request)

        async def stream() -> AsyncIterator[dict[str, str]]:
            last = None
            while not await request.is_disconnected():
                html = r.render("rows", tasks=_listing(await call("list"), status, sort))
                if html != last:
                    last = html
                    yield {"event": "rows", "data": html}
                await asyncio.sleep(POLL)

        return EventSourceResponse(stream(), ping=15)

    def _task_id(request: Request) -> str:
        try:
            return validate_task_id(request.path_params["task_id"])
        except AgentboxError:
            raise TaskNotFound("no such task") from None

    async def task_page(request: Request) -> Response:
        tid = _task_id(request)
        info = await call("get", tid)
        transcript = await call("transcript", tid, since=0, limit=2000)
        report: dict[str, Any] = {}
        diff_files: list[dict[str, Any]] = []
        truncated = False
        if info.status in ("done", "failed", "timed_out", "cancelled"):
            try:
                res = await call("result", tid)
            except AgentboxError:
                res = None
            if res is not None:
                report = res.report if isinstance(res.report, dict) else {}
                diff_files = r.diff_view(res.diff)
                truncated = res.diff_truncated
        flagged = [visible(str(f.get("path") if isinstance(f, dict) else f))
                   for f in report.get("flagged") or []]  # fmt: skip
        return page(
            "task",
            t=r.task_view(info, report),
            csrf=session.csrf(request),
            events=[r.event_view(e) for e in transcript.events],
            next=transcript.next,
            report=r.report_rows(report),
            files=[f["name"] for f in diff_files],
            diff=diff_files,
            diff_truncated=truncated,
            flagged=flagged,
        )

    async def task_events(request: Request) -> Response:
        tid = _task_id(request)
        try:
            since = max(0, int(request.query_params.get("since", "0")))
        except ValueError:
            since = 0

        async def stream() -> AsyncIterator[dict[str, str]]:
            nonlocal since
            status = None
            while not await request.is_disconnected():
                info = await call("get", tid)
                page_ = await call("transcript", tid, since=since, limit=500)
                if page_.events:
                    since = page_.next
                    views = [r.event_view(e) for e in page_.events]
                    yield {"event": "events", "data": r.render("events", events=views)}
                if info.status != status:
                    status = info.status
                    yield {"event": "status", "data": info.status}
                if info.status in ("done", "failed", "timed_out", "cancelled"):
                    yield {"event": "end", "data": info.status}
                    return
                await asyncio.sleep(POLL)

        return EventSourceResponse(stream(), ping=15)

    async def _form_ok(request: Request) -> dict[str, str]:
        form = await request.form()
        csrf = session.csrf(request) or ""
        sent = str(form.get("csrf", ""))
        if not csrf or not hmac.compare_digest(sent.encode(), csrf.encode()):
            raise RefusedError("the form's token is not this session's: reload the page")
        return {k: str(v) for k, v in form.items()}

    async def cancel(request: Request) -> Response:
        tid = _task_id(request)
        await _form_ok(request)
        await call("cancel", tid)
        return RedirectResponse(f"/tasks/{tid}", status_code=303)

    async def publish(request: Request) -> Response:
        tid = _task_id(request)
        await _form_ok(request)
        await call("publish", tid)
        return RedirectResponse(f"/tasks/{tid}", status_code=303)

    async def resume(request: Request) -> Response:
        from agentbox.launcher.api import TaskRequest

        tid = _task_id(request)
        form = await _form_ok(request)
        text = form.get("task", "").strip()
        if not text:
            raise RefusedError("say what the follow-up task should do")
        prev = await call("get", tid)
        new = await call("submit", TaskRequest(repo=prev.repo, task=text, continue_from=tid))
        return RedirectResponse(f"/tasks/{new.id}", status_code=303)

    async def group_page(request: Request) -> Response:
        gid = _task_id(request)
        view = await call("group", gid)
        return page("group", g=view, rows=r.group_rows(view), csrf=session.csrf(request))

    async def group_publish(request: Request) -> Response:
        gid = _task_id(request)
        await _form_ok(request)
        await call("publish_pick", gid)
        return RedirectResponse(f"/groups/{gid}", status_code=303)

    def _batches_dir() -> Path:
        return data_dir / "batches"

    async def batches(request: Request) -> Response:
        def read() -> list[dict[str, Any]]:
            from agentbox.cluster import BatchState

            out = []
            with contextlib.suppress(OSError):
                for d in sorted(_batches_dir().iterdir()):
                    db = d / "batch.db"
                    if d.is_symlink() or not db.is_file() or db.is_symlink():
                        continue
                    try:
                        st = BatchState(db)
                        try:
                            meta, rows = st.batch(), st.tasks()
                        finally:
                            st.close()
                    except (AgentboxError, OSError, sqlite3.Error):
                        continue  # not ours to read, or not a batch
                    out.append({
                        "id": visible(d.name), "created": r.when(meta.get("created_at")),
                        "tasks": len(rows), "done": sum(1 for x in rows if x.status == "done"),
                        "nodes": len({x.node for x in rows if x.node}),
                    })  # fmt: skip
            return out

        listed = await anyio.to_thread.run_sync(read)
        return page("batches", batches=listed, where=visible(str(_batches_dir())))

    async def batch_page(request: Request) -> Response:
        from agentbox.cluster import BatchState, batch_dir

        try:
            path = batch_dir(_batches_dir(), request.path_params["batch_id"]) / "batch.db"
        except AgentboxError:
            raise TaskNotFound("no such batch") from None

        def read() -> tuple[dict[str, Any], list[Any], int]:
            if path.is_symlink() or not path.is_file():
                raise TaskNotFound("no such batch")
            try:
                st = BatchState(path)
                try:
                    return st.batch(), st.tasks(), st.committed()
                finally:
                    st.close()
            except (OSError, sqlite3.Error):
                raise TaskNotFound("no such batch") from None

        meta, rows, committed = await anyio.to_thread.run_sync(read)
        return page("batch", **r.batch_view(meta, rows, committed))

    async def static(request: Request) -> Response:
        got = _STATIC.get(request.path_params["name"])
        if got is None:
            return PlainTextResponse("not found", status_code=404)
        return Response(got[0], media_type=got[1])

    routes = [
        Route("/login", guarded(login, login=True), methods=["GET"]),
        Route("/", guarded(task_list), methods=["GET"]),
        Route("/events/tasks", guarded(list_events), methods=["GET"]),
        Route("/tasks/{task_id}", guarded(task_page), methods=["GET"]),
        Route("/events/tasks/{task_id}", guarded(task_events), methods=["GET"]),
        Route("/tasks/{task_id}/cancel", guarded(cancel, change=True), methods=["POST"]),
        Route("/tasks/{task_id}/publish", guarded(publish, change=True), methods=["POST"]),
        Route("/tasks/{task_id}/resume", guarded(resume, change=True), methods=["POST"]),
        Route("/groups/{task_id}", guarded(group_page), methods=["GET"]),
        Route("/batches", guarded(batches), methods=["GET"]),
        Route("/batches/{batch_id}", guarded(batch_page), methods=["GET"]),
        Route("/groups/{task_id}/publish", guarded(group_publish, change=True), methods=["POST"]),
        Route("/static/{name}", guarded(static, login=True), methods=["GET"]),
    ]
    return Starlette(routes=routes), session


def socket_for(data_dir: Path) -> Path:
    from agentbox.launcher import socket_path

    path: Path = socket_path(data_dir)
    return path
