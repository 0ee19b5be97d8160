"""``AsyncSandbox`` and ``AsyncClient``: the same surface with ``async``/``await``.

Each call runs the synchronous one on a worker thread (``anyio.to_thread``), so an
event loop never blocks on the launcher; a streamed command is an async iterator::

    async with await AsyncSandbox.create() as sb:
        r = await sb.commands.run("echo hi")
        async for chunk in await sb.commands.run("pytest -q", stream=True):
            ...
        h = await sb.commands.run("sleep 30", background=True); await h.kill()

Works under asyncio and trio (anyio).
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Self, TypeVar, overload

import anyio.to_thread

from agentbox.launcher.api import TaskInfo, TaskResult
from agentbox.launcher.attempts import GroupView
from agentbox.launcher.boxapi import ExecState, FileEntry, SandboxInfo
from agentbox.launcher.pushapi import PushInfo
from agentbox.sdk._sandbox import (
    CommandHandle,
    CommandResult,
    CommandStream,
    OutputChunk,
    Sandbox,
)
from agentbox.sdk._tasks import Client, Task, TaskGroup

if TYPE_CHECKING:
    from agentbox.transcript import Event

P = ParamSpec("P")
T = TypeVar("T")
_END = object()


async def _thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def _aiter(it: Iterator[T]) -> AsyncIterator[T]:
    while (item := await anyio.to_thread.run_sync(next, it, _END)) is not _END:
        yield item  # type: ignore[misc]


class AsyncCommandStream:
    """The chunks of a command as they come (``async for``); then :attr:`result`."""

    def __init__(self, stream: CommandStream) -> None:
        self._stream = stream

    @property
    def result(self) -> CommandResult | None:
        return self._stream.result

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return _aiter(iter(self._stream))

    async def wait(self) -> CommandResult:
        return await _thread(self._stream.wait)


class AsyncCommandHandle:
    """A command running in the background."""

    def __init__(self, handle: CommandHandle) -> None:
        self._h = handle
        self.exec_id = handle.exec_id

    async def state(self) -> ExecState:
        return await _thread(self._h.state)

    async def kill(self) -> ExecState:
        return await _thread(self._h.kill)

    async def wait(self, timeout: float | None = None) -> CommandResult:  # noqa: ASYNC109 (the sync API's timeout)
        return await _thread(self._h.wait, timeout)


class AsyncCommands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    @overload
    async def run(self, cmd: str | Sequence[str], *, stream: Literal[False] = False,
                  background: Literal[False] = False, env: Mapping[str, str] | None = None,
                  cwd: str | None = None, timeout: float | None = None,  # noqa: ASYNC109 (the sync API's timeout)
                  stdin: str | None = None) -> CommandResult: ...  # fmt: skip
    @overload
    async def run(self, cmd: str | Sequence[str], *, stream: Literal[True],
                  background: Literal[False] = False, env: Mapping[str, str] | None = None,
                  cwd: str | None = None, timeout: float | None = None,  # noqa: ASYNC109 (the sync API's timeout)
                  stdin: str | None = None) -> AsyncCommandStream: ...  # fmt: skip
    @overload
    async def run(self, cmd: str | Sequence[str], *, stream: bool = False,
                  background: Literal[True], env: Mapping[str, str] | None = None,
                  cwd: str | None = None, timeout: float | None = None,  # noqa: ASYNC109 (the sync API's timeout)
                  stdin: str | None = None) -> AsyncCommandHandle: ...  # fmt: skip

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        stream: bool = False,
        background: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the sync API's timeout)
        stdin: str | None = None,
    ) -> CommandResult | AsyncCommandStream | AsyncCommandHandle:
        """As :meth:`agentbox.sdk.Commands.run`; a stream is an async iterator."""
        kw: dict[str, Any] = {"env": env, "cwd": cwd, "timeout": timeout, "stdin": stdin}
        run = self._sb.commands.run
        if background:
            return AsyncCommandHandle(await _thread(lambda: run(cmd, background=True, **kw)))
        if stream:
            # The request is sent by the first step of the iteration (on a worker thread).
            return AsyncCommandStream(run(cmd, stream=True, **kw))
        return await _thread(lambda: run(cmd, **kw))


class AsyncFiles:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    async def write(self, path: str, data: str | bytes) -> FileEntry:
        return await _thread(self._sb.files.write, path, data)

    async def read(self, path: str) -> str:
        return await _thread(self._sb.files.read, path)

    async def read_bytes(self, path: str) -> bytes:
        return await _thread(self._sb.files.read_bytes, path)

    async def list(self, path: str = "/workspace") -> builtins.list[FileEntry]:
        return await _thread(self._sb.files.list, path)


class AsyncSandbox:
    """:class:`~agentbox.sdk.Sandbox` with ``async``/``await``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sync = sandbox
        self.commands = AsyncCommands(sandbox)
        self.files = AsyncFiles(sandbox)

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def info(self) -> SandboxInfo:
        return self.sync.info

    @classmethod
    async def create(
        cls,
        image: str | None = None,
        backend: str | None = None,
        boxfile: str | os.PathLike[str] | None = None,
        timeout: float = 600,  # noqa: ASYNC109 (the sync API's timeout)
        *,
        address: str | os.PathLike[str] | None = None,
    ) -> AsyncSandbox:
        return cls(await _thread(Sandbox.create, image, backend, boxfile, timeout,
                                 address=address))  # fmt: skip

    @classmethod
    async def connect(
        cls, sandbox_id: str, *, address: str | os.PathLike[str] | None = None
    ) -> AsyncSandbox:
        return cls(await _thread(Sandbox.connect, sandbox_id, address=address))

    @classmethod
    async def list(cls, *, address: str | os.PathLike[str] | None = None) -> list[SandboxInfo]:
        return await _thread(Sandbox.list, address=address)

    async def refresh(self) -> SandboxInfo:
        return await _thread(self.sync.refresh)

    async def fork(self, n: int = 1, *, timeout: float = 600) -> builtins.list[AsyncSandbox]:  # noqa: ASYNC109 (the sync API's timeout)
        """As :meth:`agentbox.sdk.Sandbox.fork`."""
        return [AsyncSandbox(s) for s in await _thread(self.sync.fork, n, timeout=timeout)]

    async def kill(self) -> None:
        await _thread(self.sync.kill)

    async def close(self) -> None:
        await _thread(self.sync.close)

    async def upload(
        self, local_dir: str | os.PathLike[str], dest: str = "/workspace"
    ) -> builtins.list[FileEntry]:
        return await _thread(self.sync.upload, local_dir, dest)

    async def download(self, path: str, local_dir: str | os.PathLike[str]) -> Path:
        return await _thread(self.sync.download, path, local_dir)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncTask:
    """:class:`~agentbox.sdk.Task` with ``async``/``await``."""

    def __init__(self, task: Task) -> None:
        self.sync = task

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def info(self) -> TaskInfo:
        return self.sync.info

    def events(self, *, since: int = 0) -> AsyncIterator[Event]:
        return _aiter(self.sync.events(since=since))

    async def refresh(self) -> TaskInfo:
        return await _thread(self.sync.refresh)

    async def wait(self, timeout: float | None = None) -> TaskResult:  # noqa: ASYNC109 (the sync API's timeout)
        return await _thread(self.sync.wait, timeout)

    async def result(self) -> TaskResult:
        return await _thread(self.sync.result)

    async def cancel(self) -> TaskInfo:
        return await _thread(self.sync.cancel)

    async def publish(self, *, pr: bool = False, draft: bool = False) -> TaskInfo:
        return await _thread(self.sync.publish, pr=pr, draft=draft)

    async def push(self, **kwargs: Any) -> PushInfo:
        """As :meth:`agentbox.sdk.Task.push`."""
        return await _thread(self.sync.push, **kwargs)


class AsyncTaskGroup:
    """:class:`~agentbox.sdk.TaskGroup` (a best-of-N group) with ``async``/``await``."""

    def __init__(self, group: TaskGroup) -> None:
        self.sync = group
        self.id = group.id
        self.tasks = [AsyncTask(t) for t in group.tasks]

    async def view(self, *, by: str = "tests") -> GroupView:
        return await _thread(self.sync.view, by=by)

    async def wait(self, timeout: float | None = None) -> GroupView:  # noqa: ASYNC109 (the sync API's timeout)
        return await _thread(self.sync.wait, timeout)

    async def publish(self, pick: int | None = None) -> TaskInfo:
        return await _thread(self.sync.publish, pick)


class AsyncTasks:
    def __init__(self, client: Client) -> None:
        self._c = client

    @overload
    async def create(self, repo: str | os.PathLike[str], prompt: str, *,
                     attempts: None = None, **kwargs: Any) -> AsyncTask: ...  # fmt: skip
    @overload
    async def create(self, repo: str | os.PathLike[str], prompt: str, *,
                     attempts: int, **kwargs: Any) -> AsyncTaskGroup: ...  # fmt: skip

    async def create(
        self, repo: str | os.PathLike[str], prompt: str, *, attempts: int | None = None,
        **kwargs: Any,
    ) -> AsyncTask | AsyncTaskGroup:  # fmt: skip
        """As :meth:`agentbox.sdk.Tasks.create`: one task, or with ``attempts=N`` a
        best-of-N group (:class:`AsyncTaskGroup`)."""
        if attempts is not None:
            n = attempts
            return AsyncTaskGroup(await _thread(
                lambda: self._c.tasks.create(repo, prompt, attempts=n, **kwargs)))  # fmt: skip
        return AsyncTask(await _thread(lambda: self._c.tasks.create(repo, prompt, **kwargs)))

    async def group(self, group_id: str) -> AsyncTaskGroup:
        """A group of yours by its id (its attempts as they are now)."""
        return AsyncTaskGroup(await _thread(self._c.tasks.group, group_id))

    async def get(self, task_id: str) -> AsyncTask:
        return AsyncTask(await _thread(self._c.tasks.get, task_id))

    async def list(self) -> list[AsyncTask]:
        return [AsyncTask(t) for t in await _thread(self._c.tasks.list)]


class AsyncClient:
    """:class:`~agentbox.sdk.Client` with ``async``/``await``."""

    def __init__(self, address: str | os.PathLike[str] | None = None) -> None:
        self.sync = Client(address)
        self.tasks = AsyncTasks(self.sync)

    async def close(self) -> None:
        await _thread(self.sync.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
