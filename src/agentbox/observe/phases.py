"""A task's phases with their exact times, from ``logs/phases.jsonl``.

The launcher writes each line of a task's ``launcher.log`` a second time, as JSON with
its exact time (``{"t": 1796618130.179, "msg": "running claude in sandbox …"}``):
``launcher.log`` keeps whole seconds for people. :func:`task_phases` turns those lines
into the five phases the metrics and the traces report:

- ``queue``: from submission until a launcher took the task;
- ``setup``: the Boxfile's ``[setup]`` commands (absent on a cache hit or without setup);
- ``start``: the rest of the way to the agent (gateway, workspace copy, sandbox start);
- ``agent``: from the sandbox's start until the agent exited;
- ``collect``: from collection until the task's end.

The file is the launcher's own, in the task's log dir (never mounted into a sandbox);
it is still read like untrusted data: no link followed, a size cap, bad lines skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agentbox.core.files import read_regular

PHASES_FILE = "phases.jsonl"
MAX_BYTES = 1 << 20
PHASE_NAMES = ("queue", "setup", "start", "agent", "collect")


@dataclass(frozen=True)
class Span:
    """One phase: its name and its start and end (seconds since the epoch)."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class TaskPhases:
    """What :func:`task_phases` found: the phases (in order) and how often the task was
    re-adopted by a new launcher."""

    spans: tuple[Span, ...]
    readoptions: int
    finished: bool

    def get(self, name: str) -> Span | None:
        return next((s for s in self.spans if s.name == name), None)


def read_phase_lines(log_dir: Path) -> list[tuple[float, str]]:
    """``(time, message)`` of each well-formed line; [] when there is no file."""
    data = read_regular(log_dir / PHASES_FILE, MAX_BYTES)
    if data is None:
        return []
    out: list[tuple[float, str]] = []
    for raw in data.split(b"\n"):
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        t, msg = ev.get("t"), ev.get("msg")
        if isinstance(t, int | float) and not isinstance(t, bool) and isinstance(msg, str):
            out.append((float(t), msg))
    return out


def task_phases(log_dir: Path, created_at: float | None) -> TaskPhases:
    """The task's phases from its log dir; phases it never reached are absent."""
    lines = read_phase_lines(log_dir)
    if not lines:
        return TaskPhases((), 0, False)
    first = lines[0][0]
    marks: dict[str, float] = {}
    readoptions = 0
    for t, msg in lines:
        if msg.startswith("running setup ("):
            marks.setdefault("setup_start", t)
        elif msg.startswith(("setup done in ", "setup failed")):
            marks.setdefault("setup_end", t)
        elif msg.startswith("running claude in sandbox"):
            marks.setdefault("agent_start", t)
        elif msg.startswith("agent exited with code") or msg.startswith("cancelled before"):
            marks.setdefault("agent_end", t)
        elif msg.startswith("collecting the workspace"):
            marks.setdefault("collect_start", t)
        elif msg.startswith("finished: "):
            marks["end"] = t
        elif msg.startswith("re-adopted by launcher pid"):
            readoptions += 1
    spans: list[Span] = []
    if created_at is not None and created_at <= first:
        spans.append(Span("queue", created_at, first))
    setup = None
    if "setup_start" in marks:
        setup_end = marks.get("setup_end", marks.get("agent_start", marks.get("end")))
        if setup_end is not None:
            setup = Span("setup", marks["setup_start"], setup_end)
            spans.append(setup)
    if "agent_start" in marks:
        # the way to the agent, but for the setup inside it: one span from the first
        # line, shortened by setup's length so that the phases add up to the whole
        took = marks["agent_start"] - first - (setup.seconds if setup else 0.0)
        spans.append(Span("start", marks["agent_start"] - max(0.0, took), marks["agent_start"]))
        agent_end = marks.get("agent_end", marks.get("collect_start", marks.get("end")))
        if agent_end is not None:
            spans.append(Span("agent", marks["agent_start"], agent_end))
    if "collect_start" in marks and "end" in marks:
        spans.append(Span("collect", marks["collect_start"], marks["end"]))
    return TaskPhases(tuple(spans), readoptions, "end" in marks)
