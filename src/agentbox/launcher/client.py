"""A client of the launcher's unix-socket API (``agentbox launcher serve``).

Used by the MCP server and ``agentbox serve``; it has the same methods as the
in-process :class:`agentbox.launcher.Launcher`, and maps the server's error
answers back onto :mod:`agentbox.errors`::

    client = LauncherClient(settings.data_dir / "launcher.sock")
    info = client.submit(TaskRequest(repo="/home/me/src/proj", task="Fix the test"))
    info = client.wait(info.id, timeout=600)
    result = client.result(info.id)

Synchronous on purpose (one small request at a time); async callers wrap it
with ``anyio.to_thread.run_sync``.

A launcher that restarts (a crash, an upgrade, ``systemctl restart``) is back
within seconds, and its tasks go on: the client rides through it. It holds no
connection between calls (a restarted launcher has a new socket), and a call
that cannot connect (no socket yet, nobody listening) is retried with a bounded
backoff for up to ``reconnect`` seconds; a read (GET) whose connection the
launcher dropped mid-answer is retried too. A POST that reached the launcher is
never sent twice.

The client never says who it is: the launcher reads the connecting process's
uid and groups from the kernel. Only root, the launcher's uid and members of the
group ``agentbox`` are answered (anyone else cannot reach the socket, or is
disconnected before a byte of HTTP), and a non-root caller sees only its own tasks.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import ValidationError

from agentbox import errors
from agentbox.core.paths import validate_task_id
from agentbox.core.uds import unix_transport
from agentbox.core.wait import wait_until
from agentbox.launcher.api import ModelInfo, ModelList, TaskInfo, TaskList, TaskRequest, TaskResult
from agentbox.launcher.attempts import GroupView
from agentbox.launcher.boxapi import (
    SANDBOX_ID_PATTERN,
    ExecEvent,
    ExecRequest,
    ExecState,
    FileEntry,
    FileList,
    SandboxInfo,
    SandboxList,
    SandboxRequest,
)
from agentbox.launcher.pushapi import PushInfo, PushRequest
from agentbox.launcher.secretapi import SecretEntry, SecretList, SecretSet
from agentbox.secrets import check_name
from agentbox.transcript import TranscriptPage

__all__ = ["LauncherClient"]

# Error class names the server may send, mapped to the class the client raises.
_ERRORS: dict[str, type[errors.AgentboxError]] = {
    name: getattr(errors, name)
    for name in errors.__all__
    if isinstance(getattr(errors, name), type)
    and issubclass(getattr(errors, name), errors.AgentboxError)
    # These need extra constructor arguments; the generic fallbacks below cover them.
    and name not in {"CommandError", "CommandTimeout"}
}


class LauncherClient:
    """Talks to ``agentbox launcher serve`` over its unix socket."""

    def __init__(
        self, socket_path: Path | str, *, timeout: float = 30.0, reconnect: float = 30.0
    ) -> None:
        self.socket_path = Path(socket_path)
        self.reconnect = reconnect
        self._http = httpx.Client(
            # No connection kept between calls: one to a launcher that has since
            # restarted would be dead (a unix connect costs microseconds). Our
            # transport, not httpx's: each refused reconnect closes its socket.
            transport=unix_transport(self.socket_path, keepalive=False),
            base_url="http://launcher",
            timeout=timeout,
        )

    def close(self) -> None:
        """Close the connection pool; idempotent."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the API -----------------------------------------------------------

    def submit(self, request: TaskRequest) -> TaskInfo:
        """Queue a task; raises a :class:`~agentbox.errors.RefusedError` for bad input."""
        data = self._call("POST", "/v1/tasks", body=request.model_dump(mode="json"))
        return TaskInfo.model_validate(data, strict=False)

    def get(self, task_id: str) -> TaskInfo:
        """The task's current state; :class:`~agentbox.errors.TaskNotFound` if unknown."""
        data = self._call("GET", f"/v1/tasks/{validate_task_id(task_id)}")
        return TaskInfo.model_validate(data, strict=False)

    def list(self) -> list[TaskInfo]:
        """Every task this caller may see (its own; root: all), newest first."""
        data = self._call("GET", "/v1/tasks")
        return TaskList.model_validate(data, strict=False).tasks

    def cancel(self, task_id: str) -> TaskInfo:
        """Ask the launcher to stop the task (its partial result is still collected)."""
        data = self._call("POST", f"/v1/tasks/{validate_task_id(task_id)}/cancel")
        return TaskInfo.model_validate(data, strict=False)

    def publish(self, task_id: str) -> TaskInfo:
        """Publish a finished task's kept result as ``agentbox/<id>`` in its repo."""
        data = self._call("POST", f"/v1/tasks/{validate_task_id(task_id)}/publish", timeout=300.0)
        return TaskInfo.model_validate(data, strict=False)

    def push(self, task_id: str, req: PushRequest | None = None) -> PushInfo:
        """Push a finished task's result branch to its repo's remote (as the repo's owner,
        never by force) and, with ``req.pr``, open a pull request; see :mod:`agentbox.forge`."""
        body = (req or PushRequest()).model_dump(mode="json")
        data = self._call("POST", f"/v1/tasks/{validate_task_id(task_id)}/push", body=body,
                          timeout=900.0)  # fmt: skip
        return PushInfo.model_validate(data, strict=False)

    def result(self, task_id: str) -> TaskResult:
        """The finished task's report and diff; TaskError while it is still running."""
        data = self._call("GET", f"/v1/tasks/{validate_task_id(task_id)}/result")
        return TaskResult.model_validate(data, strict=False)

    def transcript(self, task_id: str, *, since: int = 0, limit: int = 200) -> TranscriptPage:
        """A page of the task's transcript (``since`` < 0: its last ``-since`` events)."""
        path = f"/v1/tasks/{validate_task_id(task_id)}/transcript?since={int(since)}"
        data = self._call("GET", f"{path}&limit={int(limit)}")
        return TranscriptPage.model_validate(data, strict=False)

    def submit_group(
        self, request: TaskRequest, attempts: int, *, budget_split: str = "split"
    ) -> builtins.list[TaskInfo]:
        """Queue a best-of-N group of ``attempts`` attempts (ids ``<group>-aK``; the group id
        is ``request.task_id`` or generated; ``budget_split`` ``split`` or ``shared``); when
        the last ends, the launcher publishes the pick as ``agentbox/<group>``."""
        from agentbox.launcher.api import GroupRequest

        req = {"request": request, "attempts": attempts, "budget_split": budget_split}
        body = GroupRequest.model_validate(req).model_dump(mode="json")
        if budget_split == "split":
            del body["budget_split"]  # the default: a launcher that predates it still answers
        data = self._call("POST", "/v1/groups", body=body)
        return TaskList.model_validate(data, strict=False).tasks

    def group(self, group: str, *, by: str = "tests") -> GroupView:
        """The group's attempts scored and its pick by rule ``by``."""
        data = self._call("GET", f"/v1/groups/{validate_task_id(group)}?by={by}")
        return GroupView.model_validate(data, strict=False)

    def publish_pick(self, group: str, pick: int | None = None) -> TaskInfo:
        """Publish the group's pick (or attempt ``pick``) as ``agentbox/<group>``."""
        query = "" if pick is None else f"?pick={int(pick)}"
        data = self._call("POST", f"/v1/groups/{validate_task_id(group)}/publish{query}",
                          timeout=300.0)  # fmt: skip
        return TaskInfo.model_validate(data, strict=False)

    def models(self) -> builtins.list[ModelInfo]:
        """The models a task may name."""
        data = self._call("GET", "/v1/models")
        return ModelList.model_validate(data, strict=False).models

    # -- secrets (routes in agentbox.launcher.secretapi; the owner is this process's uid) --

    def secret_list(self, *, all_users: bool = False) -> builtins.list[SecretEntry]:
        """The secrets this caller's tasks can use (root with ``all_users``: everyone's)."""
        data = self._call("GET", "/v1/secrets" + ("?all=1" if all_users else ""))
        return SecretList.model_validate(data, strict=False).secrets

    def secret_set(self, name: str, value: str, *, shared: bool = False) -> SecretEntry:
        """Store ``value`` as this caller's secret ``name`` (``shared``: root only)."""
        body = SecretSet(value=value, shared=shared).model_dump(mode="json")
        data = self._call("PUT", f"/v1/secrets/{check_name(name)}", body=body)
        return SecretEntry.model_validate(data, strict=False)

    def secret_remove(self, name: str) -> SecretEntry:
        """Remove this caller's secret ``name``; :class:`~agentbox.errors.SecretNotFound`."""
        data = self._call("DELETE", f"/v1/secrets/{check_name(name)}")
        return SecretEntry.model_validate(data, strict=False)

    def wait(self, task_id: str, timeout: float | None = None, *, poll: float = 0.5) -> TaskInfo:
        """Poll until the task is terminal; :class:`~agentbox.errors.TaskError` past ``timeout``."""
        last: list[TaskInfo] = []

        def ended() -> TaskInfo | None:
            last[:] = [self.get(task_id)]
            return last[0] if last[0].terminal else None

        return wait_until(
            ended,
            timeout=math.inf if timeout is None else timeout,
            on_timeout=lambda: errors.TaskError(
                f"still {last[0].status} after {timeout:g}s", task_id=task_id
            ),
            interval=poll,
        )

    # -- sandboxes (agentbox.sdk; routes in agentbox.launcher.boxapi) --------

    def sandbox_create(self, request: SandboxRequest) -> SandboxInfo:
        """Start a sandbox held by this process (removed once it is gone, or at its deadline)."""
        data = self._call("POST", "/v1/sandboxes", body=request.model_dump(mode="json"),
                          timeout=300.0)  # fmt: skip
        return SandboxInfo.model_validate(data, strict=False)

    def sandbox_list(self) -> builtins.list[SandboxInfo]:
        return self.sandbox_listing().sandboxes

    def sandbox_listing(self) -> SandboxList:
        """The caller's sandboxes, and whether a warm spare waits."""
        data = self._call("GET", "/v1/sandboxes")
        return SandboxList.model_validate(data, strict=False)

    def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        data = self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}")
        return SandboxInfo.model_validate(data, strict=False)

    def sandbox_connect(self, sandbox_id: str) -> SandboxInfo:
        """Hold sandbox ``sandbox_id`` from this process too."""
        data = self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/connect")
        return SandboxInfo.model_validate(data, strict=False)

    def sandbox_fork(
        self, sandbox_id: str, n: int, *, timeout: float = 600.0
    ) -> builtins.list[SandboxInfo]:
        """``n`` new sandboxes held by this process, each from ``sandbox_id``'s files."""
        from agentbox.launcher.boxapi import ForkRequest

        body = ForkRequest(n=n, timeout=float(timeout)).model_dump(mode="json")
        data = self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/fork", body=body,
                          timeout=1800.0)  # fmt: skip
        return SandboxList.model_validate(data, strict=False).sandboxes

    def sandbox_remove(self, sandbox_id: str) -> SandboxInfo:
        data = self._call("DELETE", f"/v1/sandboxes/{_sid(sandbox_id)}", timeout=300.0)
        return SandboxInfo.model_validate(data, strict=False)

    def sandbox_exec(self, sandbox_id: str, request: ExecRequest) -> Iterator[ExecEvent]:
        """Run a command; its output chunks as they come, then its ``exit`` event."""
        path = f"/v1/sandboxes/{_sid(sandbox_id)}/exec"
        with self._http.stream("POST", path, json=request.model_dump(mode="json"),
                               timeout=httpx.Timeout(30.0, read=None)) as resp:  # fmt: skip
            if not resp.is_success:
                resp.read()
                raise self._answer_error(resp)
            for line in resp.iter_lines():
                if line.strip():
                    yield ExecEvent.model_validate_json(line, strict=False)

    def sandbox_start(self, sandbox_id: str, request: ExecRequest) -> ExecState:
        """Run a command in the background (``request.background`` set)."""
        data = self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/exec",
                          body=request.model_dump(mode="json"))  # fmt: skip
        return ExecState.model_validate(data, strict=False)

    def sandbox_exec_state(self, sandbox_id: str, exec_id: str) -> ExecState:
        data = self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/exec/{_eid(exec_id)}")
        return ExecState.model_validate(data, strict=False)

    def sandbox_kill(self, sandbox_id: str, exec_id: str) -> ExecState:
        data = self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/exec/{_eid(exec_id)}/kill",
                          timeout=120.0)  # fmt: skip
        return ExecState.model_validate(data, strict=False)

    def sandbox_write(self, sandbox_id: str, path: str, data: bytes) -> FileEntry:
        got = self._call("PUT", f"/v1/sandboxes/{_sid(sandbox_id)}/files", content=data,
                         params={"path": path}, timeout=300.0)  # fmt: skip
        return FileEntry.model_validate(got, strict=False)

    def sandbox_read(self, sandbox_id: str, path: str) -> bytes:
        return self._bytes(f"/v1/sandboxes/{_sid(sandbox_id)}/files", path)

    def sandbox_list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        got = self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/dir", params={"path": path})
        return FileList.model_validate(got, strict=False).entries

    def sandbox_upload(
        self, sandbox_id: str, dest: str, archive: bytes
    ) -> builtins.list[FileEntry]:
        got = self._call("PUT", f"/v1/sandboxes/{_sid(sandbox_id)}/archive", content=archive,
                         params={"path": dest}, timeout=900.0)  # fmt: skip
        return FileList.model_validate(got, strict=False).entries

    def sandbox_download(self, sandbox_id: str, path: str) -> bytes:
        """A tar of ``path`` in the sandbox (unpack it with ``safepath.SafeWriter``)."""
        return self._bytes(f"/v1/sandboxes/{_sid(sandbox_id)}/archive", path)

    def _bytes(self, url: str, path: str) -> bytes:
        resp = self._send("GET", url, params={"path": path}, timeout=900.0)
        if not resp.is_success:
            raise self._answer_error(resp)
        return resp.content

    def _answer_error(self, resp: httpx.Response) -> errors.AgentboxError:
        try:
            data = resp.json()
        except (json.JSONDecodeError, ValueError):
            data = None
        return _error_from(resp.status_code, data)

    # -- plumbing ----------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send, retrying what a launcher restart causes (see the module docstring)."""
        end = time.monotonic() + self.reconnect
        delay, dropped_retries = 0.05, 3
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        while True:
            try:
                return self._http.request(method, path, json=body, content=content,
                                          params=params, **extra)  # fmt: skip
            except httpx.ConnectError as exc:
                if _eacces(exc) or time.monotonic() + delay > end:
                    raise
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                # Dropped mid-answer: a read is retried (a few times: a peer the launcher
                # refuses is dropped the same way, and must hear so soon).
                dropped_retries -= 1
                if method != "GET" or dropped_retries < 0 or _eacces(exc):
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        resp = self._send(method, path, body=body, content=content, params=params,
                          timeout=timeout)  # fmt: skip
        try:
            data = resp.json()
        except (json.JSONDecodeError, ValueError) as exc:
            raise errors.TaskError(
                f"launcher answered {resp.status_code} with a body that is not JSON"
            ) from exc
        if resp.is_success:
            return data
        raise _error_from(resp.status_code, data)

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        try:
            return self._request(method, path, body, content=content, params=params,
                                 timeout=timeout)  # fmt: skip
        except httpx.TransportError as exc:
            hint = ""
            # EACCES on connect, or a connection the launcher dropped before answering
            # (a clean close or a reset, depending on timing): its peer check refused us.
            dropped = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
            if isinstance(exc, dropped) or _denied(exc):
                hint = (
                    " (only root and members of the group agentbox may use the launcher; "
                    f"this is uid {os.geteuid()})"
                )
            raise errors.TaskError(
                f"cannot reach the launcher at {self.socket_path}: {exc}{hint}"
            ) from exc


def _sid(sandbox_id: str) -> str:
    if not re.fullmatch(SANDBOX_ID_PATTERN, sandbox_id):
        raise errors.SandboxGone(f"no sandbox {sandbox_id[:40]!r}")
    return sandbox_id


def _eid(exec_id: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16}", exec_id):
        raise errors.SandboxGone(f"no command {exec_id[:40]!r}")
    return exec_id


def _eacces(exc: BaseException) -> bool:
    """True when EACCES is somewhere in ``exc``'s chain (the socket's mode refused us)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, PermissionError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _denied(exc: BaseException) -> bool:
    """True when EACCES or ECONNRESET is somewhere in ``exc``'s chain."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (PermissionError, ConnectionResetError)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _error_from(status: int, data: Any) -> errors.AgentboxError:
    name = data.get("error") if isinstance(data, dict) else None
    message = data.get("message") if isinstance(data, dict) else None
    message = str(message)[:4000] if message is not None else f"launcher answered {status}"
    if name == "SecretNotFound" and isinstance(data.get("name"), str):
        uid = data.get("uid")
        return errors.SecretNotFound(data["name"][:64], uid=uid if isinstance(uid, int) else None)
    cls = _ERRORS.get(name) if isinstance(name, str) else None
    if cls is None:
        cls = errors.RefusedError if status in (400, 422) else errors.TaskError
    try:
        return cls(message)
    except (TypeError, ValidationError):
        return errors.TaskError(message)
