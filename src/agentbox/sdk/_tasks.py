"""``Client``: hand tasks to the launcher from Python, follow them, take their results.

::

    c = Client()                                   # the local launcher; Client(address=…)
    t = c.tasks.create(repo="~/src/proj", prompt="Fix the flaky test", model="sonnet")
    for ev in t.events(): ...                      # transcript events, live
    res = t.wait(timeout=3600)                     # res.status, .branch, .diff, .report, .cost_usd

The objects are the launcher's wire models, the ones ``agentbox … --json`` prints
and the MCP server answers with: :class:`~agentbox.launcher.api.TaskInfo` (a task's
state), :class:`~agentbox.launcher.api.TaskResult` (what it left) and
:class:`~agentbox.transcript.Event` (one transcript event, as ``agentbox logs --json``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Self, overload

from agentbox.launcher.api import TaskInfo, TaskRequest, TaskResult
from agentbox.launcher.attempts import GroupView
from agentbox.launcher.client import LauncherClient
from agentbox.launcher.pushapi import PushInfo, PushRequest
from agentbox.sdk._transport import connect

if TYPE_CHECKING:
    from agentbox.transcript import Event


class Task:
    """One task in the launcher; :attr:`info` is its state as last read."""

    def __init__(self, client: LauncherClient, info: TaskInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    def refresh(self) -> TaskInfo:
        self.info = self._client.get(self.id)
        return self.info

    def events(self, *, since: int = 0, poll: float = 0.5) -> Iterator[Event]:
        """Its transcript events (``agentbox logs --json``'s), as they come, until it ended."""
        while True:
            ended = self.refresh().terminal  # read first: its last events are written by then
            page = self._client.transcript(self.id, since=since, limit=500)
            yield from page.events
            if page.next > since:
                since = page.next
                continue
            if ended:
                return
            time.sleep(poll)

    def wait(self, timeout: float | None = None, *, poll: float = 0.5) -> TaskResult:
        """Until it ended (:class:`~agentbox.errors.TaskError` past ``timeout``); its result."""
        self.info = self._client.wait(self.id, timeout, poll=poll)
        return self._client.result(self.id)

    def result(self) -> TaskResult:
        """What it left (:class:`~agentbox.errors.TaskError` while it runs)."""
        return self._client.result(self.id)

    def cancel(self) -> TaskInfo:
        """Stop it; its partial result is still collected."""
        self.info = self._client.cancel(self.id)
        return self.info

    def publish(self, *, pr: bool = False, draft: bool = False) -> TaskInfo:
        """Fetch its result branch ``agentbox/<id>`` into its repo; ``pr``: also push it and
        open a pull request (as :meth:`push`; its URL is in the report's ``pull_request``)."""
        if pr:
            self.push(pr=True, draft=draft)
            self.info = self._client.get(self.id)
            return self.info
        self.info = self._client.publish(self.id)
        return self.info

    def push(
        self,
        *,
        pr: bool = False,
        draft: bool = False,
        remote: str = "origin",
        base: str | None = None,
    ) -> PushInfo:
        """Publish it, push the branch to the repo's ``remote`` as the repo's owner (hooks
        off, never by force) and, with ``pr``, open a pull request whose body is the report,
        with your ``agentbox secret`` GITHUB_TOKEN / GITLAB_TOKEN."""
        req = PushRequest(remote=remote, pr=pr, draft=draft, base=base)
        return self._client.push(self.id, req)


class TaskGroup:
    """A best-of-N group (``tasks.create(…, attempts=N)``): :attr:`tasks` are its attempts
    ``<id>-a1`` …; the launcher publishes the pick as ``agentbox/<id>`` when all ended."""

    def __init__(self, client: LauncherClient, infos: list[TaskInfo]) -> None:
        self._client = client
        self.id: str = infos[0].group or ""
        self.tasks = [Task(client, i) for i in infos]

    def view(self, *, by: str = "tests") -> GroupView:
        """The attempts scored (tests, status, diff size, flagged, tokens, cost, time) and
        the pick by rule ``by`` (``tests``: the first that passed, then the smallest diff)."""
        return self._client.group(self.id, by=by)

    def wait(self, timeout: float | None = None, *, poll: float = 0.5) -> GroupView:
        """Until every attempt ended (:class:`~agentbox.errors.TaskError` past ``timeout``,
        counted for the whole group); the group's view."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in self.tasks:
            left = None if end is None else max(0.0, end - time.monotonic())
            t.info = self._client.wait(t.id, left, poll=poll)
        return self.view()

    def publish(self, pick: int | None = None) -> TaskInfo:
        """The pick (or attempt ``pick``) as ``agentbox/<id>`` in the repo."""
        return self._client.publish_pick(self.id, pick)


class Tasks:
    """``client.tasks``."""

    def __init__(self, client: LauncherClient) -> None:
        self._client = client

    @overload
    def create(
        self, repo: str | os.PathLike[str], prompt: str, *, attempts: None = None,
        model: str | None = None, budget_usd: float | None = None,
        budget_tokens: int | None = None, deadline: float | None = None,
        task_id: str | None = None, include_uncommitted: bool = False, publish: bool = True,
    ) -> Task: ...  # fmt: skip

    @overload
    def create(
        self, repo: str | os.PathLike[str], prompt: str, *, attempts: int,
        model: str | None = None, budget_usd: float | None = None,
        budget_tokens: int | None = None, deadline: float | None = None,
        task_id: str | None = None, include_uncommitted: bool = False, publish: bool = True,
        budget_split: Literal["split", "shared"] = "split",
    ) -> TaskGroup: ...  # fmt: skip

    def create(
        self,
        repo: str | os.PathLike[str],
        prompt: str,
        *,
        attempts: int | None = None,
        model: str | None = None,
        budget_usd: float | None = None,
        budget_tokens: int | None = None,
        deadline: float | None = None,
        task_id: str | None = None,
        include_uncommitted: bool = False,
        publish: bool = True,
        budget_split: Literal["split", "shared"] = "split",
    ) -> Task | TaskGroup:
        """Queue a task on ``repo`` (a git repo of yours under the repos root); with
        ``attempts=N``, N attempts of it as one best-of-N group (:class:`TaskGroup`)
        whose budget is ``budget_split``: ``split`` (each attempt the budgets divided by
        N) or ``shared`` (all draw from the one budget, never passed in total)."""
        req = self._request(repo, prompt, model, budget_usd, budget_tokens, deadline, task_id,
                            include_uncommitted, publish)  # fmt: skip
        if attempts is not None:
            return TaskGroup(self._client, self._client.submit_group(
                req, attempts, budget_split=budget_split))  # fmt: skip
        if budget_split != "split":
            raise TypeError("budget_split= goes with attempts=")
        return Task(self._client, self._client.submit(req))

    def create_group(
        self,
        repo: str | os.PathLike[str],
        prompt: str,
        *,
        attempts: int,
        model: str | None = None,
        budget_usd: float | None = None,
        budget_tokens: int | None = None,
        deadline: float | None = None,
        task_id: str | None = None,
        include_uncommitted: bool = False,
        publish: bool = True,
        budget_split: Literal["split", "shared"] = "split",
    ) -> TaskGroup:
        """Queue ``attempts`` (1..8) attempts of the task as one best-of-N group; each gets
        the budgets divided by ``attempts`` (``budget_split="shared"``: all draw from the
        one budget); ``task_id`` names the group."""
        req = self._request(repo, prompt, model, budget_usd, budget_tokens, deadline, task_id,
                            include_uncommitted, publish)  # fmt: skip
        return TaskGroup(self._client, self._client.submit_group(
            req, attempts, budget_split=budget_split))  # fmt: skip

    @staticmethod
    def _request(
        repo: str | os.PathLike[str], prompt: str, model: str | None, budget_usd: float | None,
        budget_tokens: int | None, deadline: float | None, task_id: str | None,
        include_uncommitted: bool, publish: bool,
    ) -> TaskRequest:  # fmt: skip
        path = Path(repo).expanduser().absolute()
        return TaskRequest(repo=str(path), task=prompt, model=model, budget=budget_tokens,
                           budget_usd=None if budget_usd is None else float(budget_usd),
                           deadline=deadline, task_id=task_id,
                           include_uncommitted=include_uncommitted, publish=publish)  # fmt: skip

    def get(self, task_id: str) -> Task:
        return Task(self._client, self._client.get(task_id))

    def group(self, group_id: str) -> TaskGroup:
        """A best-of-N group of yours by its id, its attempts as they are now."""
        view = self._client.group(group_id)
        return TaskGroup(self._client, [self._client.get(a.id) for a in view.attempts])

    def list(self) -> list[Task]:
        """Your tasks (root: everyone's), newest first."""
        return [Task(self._client, i) for i in self._client.list()]


class Client:
    """A client of the launcher (``agentbox launcher serve``) over its unix socket."""

    def __init__(self, address: str | os.PathLike[str] | None = None) -> None:
        self._client = connect(address)
        self.tasks = Tasks(self._client)

    @property
    def transport(self) -> LauncherClient:
        """The launcher client underneath (the same one the CLI and MCP use)."""
        return self._client

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
