"""Following a task as it runs: the progress line and the transcript, live or piped.

Used by ``run`` (the in-process launcher; Ctrl-C cancels the task) and ``watch``
(any launcher; Ctrl-C only stops watching). On a terminal: a spinner with the
status, time, tokens and the tool call in flight, the transcript's events printed
above it. Piped (CI): the task id at once, then one line per event.

Whatever the terminal does, the task's state converges: a closed terminal (a
hang-up, or output that fails with EIO/EPIPE) stops the printing, never the
following or the collection.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from agentbox.cli._logs import event_lines
from agentbox.cli._view import err, progress_line, safe
from agentbox.core.text import visible
from agentbox.launcher.api import TaskInfo
from agentbox.transcript import Event, TranscriptPage


class Tail(Protocol):
    """New transcript lines since the last call, and the tool call in flight."""

    current: str

    def new_lines(self) -> list[Text]: ...


class PageTail:
    """A :class:`Tail` over the launcher's ``transcript`` pages (in-process or over the socket)."""

    def __init__(self, fetch: Callable[[int], TranscriptPage]) -> None:
        self.fetch = fetch
        self.next = 0
        self.current = ""
        self._open: dict[str | None, Event] = {}

    def new_lines(self) -> list[Text]:
        out: list[Text] = []
        for _ in range(50):  # at most 50 pages a poll: a long backlog is caught up over polls
            page = self.fetch(self.next)
            for e in page.events:
                if e.kind == "tool_call":
                    self._open[e.tool_id] = e
                elif e.kind == "tool_result":
                    self._open.pop(e.tool_id, None)
                lines = event_lines(e, full=False)
                out.extend(lines[:1] + lines[1:][-4:] if e.kind == "tool_result" else lines)
            self.next = page.next
            if not page.events or page.next >= page.total:
                break
        last = list(self._open.values())[-1:]
        if last:
            what = f"$ {last[0].input}" if last[0].tool == "Bash" else (last[0].input or "")
            flat = " ".join(what.split())
            self.current = visible(f"{last[0].tool} {flat[:80]}")
        else:
            self.current = ""
        return out


def quiet_print(console: Any, *objs: Any, **kwargs: Any) -> bool:
    """Print, or return False once the terminal is gone (EIO after a hang-up, EPIPE)."""
    try:
        console.print(*objs, **kwargs)
    except OSError:
        return False
    return True


def follow(
    get: Callable[[], TaskInfo],
    tail: Tail,
    *,
    live: bool,
    events: bool,
    poll: float = 0.5,
    wait: Callable[[float], TaskInfo] | None = None,
) -> TaskInfo:
    """Poll ``get`` until the task is terminal, printing its events from ``tail``.

    ``wait(seconds)``, when given, replaces a pause and the next ``get``: it returns
    the task's info at its end or after ``seconds`` (an in-process launcher wakes on
    the end), so the command ends when the task does, not at its next poll.

    ``live`` (a terminal): the spinner and the events above it; ``events`` without
    ``live``: the task id at once and one line per event; neither: silent. A
    :class:`KeyboardInterrupt` (Ctrl-C, or any ending signal made one) propagates:
    the caller decides whether it cancels the task or only stops following.
    """
    info = get()
    if not live:
        if events:
            quiet_print(err, safe(f"task {info.id} {info.status} (agentbox logs {info.id})"))
        while True:
            if events:
                for line in tail.new_lines():
                    if not quiet_print(err, line, soft_wrap=True):
                        events = False  # the terminal went away: keep following, silently
                        break
            if info.terminal:
                return info
            info = _next(get, wait, poll)
    spinner = Spinner("dots")
    lv = Live(progress_line(info, spinner), console=err, refresh_per_second=8)
    try:
        lv.start()
    except OSError:
        return follow(get, tail, live=False, events=False, poll=poll, wait=wait)
    try:
        polls = 0
        while True:
            if polls % 4 == 0 or info.terminal:  # the transcript about once a second
                for line in tail.new_lines():
                    lv.console.print(line, soft_wrap=True)
            polls += 1
            lv.update(progress_line(info, spinner, tail.current))
            if info.terminal:
                return info
            info = _next(get, wait, 0.25)
    except OSError:
        # The terminal is gone (EIO after a hang-up): stop drawing, keep following.
        _stop_quietly(lv)
        return follow(get, tail, live=False, events=False, poll=poll, wait=wait)
    finally:
        _stop_quietly(lv)


def _next(
    get: Callable[[], TaskInfo], wait: Callable[[float], TaskInfo] | None, pause: float
) -> TaskInfo:
    if wait is not None:
        return wait(pause)
    time.sleep(pause)
    return get()


def _stop_quietly(lv: Live) -> None:
    with contextlib.suppress(OSError, ValueError):
        lv.stop()
