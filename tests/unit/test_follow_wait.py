"""`agentbox run` ends when its task does, not at its next poll.

The follow loop used to sleep its poll (0.5 s, 0.25 s drawing a spinner) between
looks, so a task's end was seen up to a poll late. Given a ``wait`` (an in-process
launcher's, which wakes on a task's end), it waits on that instead.
"""

from __future__ import annotations

from typing import Any

from agentbox.cli._follow import follow
from agentbox.cli._run import _wait_at_most
from agentbox.errors import TaskError
from agentbox.launcher.api import TaskInfo

BASE: dict[str, Any] = {"id": "t-000000000001", "repo": "/r", "task": "x", "model": "m",
                        "budget": 10, "deadline": 60.0, "created_at": 1.0}  # fmt: skip


class NoTail:
    current = ""

    def new_lines(self) -> list[Any]:
        return []


def test_follow_waits_on_the_end_instead_of_sleeping_its_poll() -> None:
    gets: list[int] = []
    waits: list[float] = []

    def get() -> TaskInfo:
        gets.append(1)
        return TaskInfo(status="running", **BASE)

    def wait(seconds: float) -> TaskInfo:
        waits.append(seconds)
        return TaskInfo(status="done" if len(waits) == 2 else "running", **BASE)

    # A poll of an hour: only a wait that returns at the end lets this test finish.
    info = follow(get, NoTail(), live=False, events=False, poll=3600.0, wait=wait)
    assert info.status == "done"
    assert waits == [3600.0, 3600.0] and gets == [1]  # one look first, then only waits


class Launcher:
    def __init__(self, ends: bool) -> None:
        self.ends = ends
        self.calls: list[tuple[str, float | None]] = []

    def wait(self, task_id: str, timeout: float | None = None) -> TaskInfo:
        self.calls.append(("wait", timeout))
        if not self.ends:
            raise TaskError("still running after 0.5s", task_id=task_id)
        return TaskInfo(status="done", **BASE)

    def get(self, task_id: str) -> TaskInfo:
        self.calls.append(("get", None))
        return TaskInfo(status="running", **BASE)


def test_wait_at_most_returns_the_end_or_the_task_as_it_is() -> None:
    ended = Launcher(ends=True)
    assert _wait_at_most(ended, BASE["id"], 0.5).status == "done"
    assert ended.calls == [("wait", 0.5)]
    running = Launcher(ends=False)
    assert _wait_at_most(running, BASE["id"], 0.5).status == "running"
    assert running.calls == [("wait", 0.5), ("get", None)]
