"""``agentbox logs ID [-f] [--json] [--full]``: a task's transcript for people and scripts.

Reads :func:`agentbox.transcript.read_transcript` (the one parse of Claude Code's
stream-json, the launcher's phases and the gateway's refusals) and prints one
line per event with its time: each tool call with its input and, under it, its
result (exit code and the output's last lines; ``--full`` all of it). No raw
heartbeats. Every string the agent could have written goes through
:func:`agentbox.core.text.visible` and is printed as plain :class:`~rich.text.Text`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rich.console import Console
from rich.text import Text

from agentbox.core.text import visible
from agentbox.transcript import Event, Transcript, read_transcript

#: Lines of a tool's output shown by default (``--full``: all).
TAIL_LINES = 12
#: The cap of a tool's output with ``--full`` (the rest stays in agent.jsonl).
FULL_OUTPUT_CHARS = 1 << 20

_SOURCE_STYLE = {"launcher": "blue", "agent": "", "gateway": "yellow"}


def _lines(n: int) -> str:
    return "1 line" if n == 1 else f"{n:,} lines"


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "--:--:--"


def _one_line(text: str, n: int = 300) -> str:
    flat = " ⏎ ".join(ln for ln in text.strip().splitlines() if ln.strip())
    return flat if len(flat) <= n else flat[:n] + "…"


def event_lines(e: Event, *, full: bool) -> list[Text]:
    """One event as printable lines; a turn's first event is preceded by its tokens."""
    lines = _event_lines(e, full=full)
    if e.tokens is not None:
        t = e.tokens
        said = (
            f"{_clock(e.time)} {'turn':<8} tokens (metered by the gateway): in {t.input:,} · "
            f"out {t.output:,} · cache {t.cache_read + t.cache_creation:,}"
            + (f" · ${t.cost_usd:.4f}" if t.cost_usd is not None else "")
        )
        lines.insert(0, Text(said, style="dim"))
    return lines


def _event_lines(e: Event, *, full: bool) -> list[Text]:
    """One event as printable lines (plain text: the agent's characters made visible)."""
    head = Text(f"{_clock(e.time)} ", style="dim")
    pad = " " * 9
    if e.kind == "tool_call":
        shown = f"$ {e.input}" if e.tool == "Bash" else (e.input or "")
        head.append(f"{visible(e.tool or '?'):<8} ", style="bold cyan")
        head.append(visible(shown if full else _one_line(shown, 400)))
        return [head]
    if e.kind == "tool_result":
        out = e.text.rstrip("\n")
        lines = out.splitlines()
        if e.exit_code is not None:
            status = f"exit {e.exit_code}"
        else:
            status = "error" if e.is_error else "ok"
        size = e.output_chars or 0
        more = f", {size:,} chars" if size > 200 else ""
        style = "red" if e.is_error or (e.exit_code or 0) != 0 else "green"
        head.append(f"  ↳ {visible(e.tool or '?')} {status}", style=style)
        if e.written_lines is not None:  # its output is one line; what it wrote is the news
            said = f" (wrote {_lines(e.written_lines)})"
        else:
            said = f" ({_lines(len(lines))}{more})" if lines else " (no output)"
        head.append(said, style="dim")
        kept = lines if full else lines[-TAIL_LINES:]
        res = [head]
        if len(kept) < len(lines):
            res.append(
                Text(
                    f"{pad}  … {len(lines) - len(kept)} earlier lines "
                    "(agentbox logs --full shows them)",
                    style="dim",
                )
            )
        res.extend(Text(f"{pad}  {visible(ln)}") for ln in kept)
        if size > len(e.text):
            res.append(
                Text(
                    f"{pad}  (output cut to its last {len(e.text):,} characters; "
                    f"all of it: logs/agent.jsonl line {e.line})",
                    style="dim",
                )
            )
        return res
    label = {"phase": "launcher", "refusal": "gateway", "error": "ERROR", "stop": "model"}.get(
        e.kind, "agent"
    )
    style = {"error": "bold red", "refusal": "yellow", "phase": "blue", "stop": "yellow"}.get(
        e.kind, ""
    )
    head.append(f"{label:<8} ", style=style or _SOURCE_STYLE.get(e.source, ""))
    text = e.text if full or e.kind != "text" else _one_line(e.text, 600)
    body = visible(text).splitlines() or [""]
    head.append(body[0], style="bold red" if e.kind == "error" else "")
    return [head, *(Text(f"{pad}{' ' * 9}{ln}") for ln in body[1:])]


def _footer(t: Transcript) -> list[Text]:
    tk = t.tokens
    out = [
        Text(
            f"tokens (metered by the gateway): in {tk.input:,} · out {tk.output:,} · cache "
            f"{tk.cache_read + tk.cache_creation:,} · {t.turns} turns",
            style="dim",
        )
    ]
    if t.skipped_lines or t.truncated:
        out.append(
            Text(
                f"({t.skipped_lines} unreadable lines of agent.jsonl skipped"
                f"{'; caps hit, some events missing' if t.truncated else ''})",
                style="yellow",
            )
        )
    return out


def _stderr_tail(task_root: Path, full: bool) -> list[Text]:
    try:
        with (task_root / "logs" / "agent.stderr").open("rb") as fh:
            data = fh.read(1 << 20)
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    if not lines:
        return []
    shown = lines if full else lines[-20:]
    return [Text("agent's stderr:", style="bold")] + [Text(f"  {visible(x)}") for x in shown]


def print_logs(
    console: Console, task_root: Path, *, created_at: float, full: bool, as_json: bool
) -> None:
    """The whole transcript, once."""
    cap = FULL_OUTPUT_CHARS if full else 8_000
    t = read_transcript(task_root, created_at=created_at, max_output=cap)
    if as_json:
        sys.stdout.write(t.model_dump_json(indent=1) + "\n")
        return
    for e in t.events:
        for line in event_lines(e, full=full):
            console.print(line, soft_wrap=True)
    for line in [*_footer(t), *_stderr_tail(task_root, full), *_egress_lines(task_root, full)]:
        console.print(line, soft_wrap=True)


def _egress_lines(task_root: Path, full: bool) -> list[Text]:
    """The egress proxy's requests per phase (the last 30 of each, all with ``--full``)."""
    import json

    from agentbox.egress import format_record

    out: list[Text] = []
    for phase in ("setup", "agent"):
        try:
            with (task_root / "logs" / f"egress-{phase}.jsonl").open("rb") as fh:
                data = fh.read(16 << 20)
        except OSError:
            continue
        recs = []
        for raw in data.splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict):
                recs.append(rec)
        if not recs:
            continue
        shown = recs if full else recs[-30:]
        out.append(Text(f"egress ({phase} phase, {len(recs)} lines):", style="bold"))
        for rec in shown:
            style = "yellow" if rec.get("decision") == "denied" else ""
            out.append(Text(f"  {visible(format_record(rec))}", style=style))
            if isinstance(rec.get("suggest"), str):
                out.append(Text("    to allow it, add to the Boxfile:", style="dim"))
                out += [Text(f"      {visible(x)}") for x in rec["suggest"].splitlines()]
    return out


def follow_logs(
    console: Console,
    task_root: Path,
    *,
    created_at: float,
    full: bool,
    as_json: bool,
    finished: Callable[[], bool],
    interval: float = 0.5,
) -> None:
    """Print events as they come until ``finished()`` (``--json``: one JSON event a line)."""
    cap = FULL_OUTPUT_CHARS if full else 8_000
    seen: dict[str, int] = {"launcher": 0, "agent": 0}
    said: set[str] = set()
    while True:
        done = finished()  # read before the files: the last events are in them by then
        t = read_transcript(task_root, created_at=created_at, max_output=cap)
        for e in _new(t.events, seen, said):
            if as_json:
                sys.stdout.write(json.dumps(e.model_dump(mode="json")) + "\n")
                sys.stdout.flush()
            else:
                for line in event_lines(e, full=full):
                    console.print(line, soft_wrap=True)
        if done:
            if not as_json:
                for line in _footer(t):
                    console.print(line, soft_wrap=True)
            return
        time.sleep(interval)


def _new(events: Iterable[Event], seen: dict[str, int], said: set[str]) -> list[Event]:
    """The events not printed yet: launcher and agent events append only; a gateway
    refusal line is new when its text is (its count went up)."""
    count = dict.fromkeys(seen, 0)
    out = []
    for e in events:
        if e.source == "gateway":
            if e.text not in said:
                said.add(e.text)
                out.append(e)
            continue
        count[e.source] += 1
        if count[e.source] > seen[e.source]:
            out.append(e)
    seen.update(count)
    return out


class EventTail:
    """The new events of a running task, for ``agentbox run``'s progress: its lines
    one per event and the tool call in flight."""

    def __init__(self, task_root: Path, created_at: float) -> None:
        self.root = task_root
        self.created_at = created_at
        self.seen: dict[str, int] = {"launcher": 0, "agent": 0}
        self.said: set[str] = set()
        self.current = ""
        """The tool call still waiting for its result ("" when none)."""

    def new_lines(self) -> list[Text]:
        """Lines for the events since the last call (and ``current`` updated)."""
        t = read_transcript(self.root, created_at=self.created_at, max_output=4_000)
        open_calls: dict[str | None, Event] = {}
        for e in t.events:
            if e.kind == "tool_call":
                open_calls[e.tool_id] = e
            elif e.kind == "tool_result":
                open_calls.pop(e.tool_id, None)
        running = list(open_calls.values())[-1:] if open_calls else []
        if running:
            e = running[0]
            what = f"$ {e.input}" if e.tool == "Bash" else (e.input or "")
            self.current = visible(f"{e.tool} {_one_line(what, 80)}")
        else:
            self.current = ""
        out: list[Text] = []
        for e in _new(t.events, self.seen, self.said):
            lines = event_lines(e, full=False)
            out.extend(lines[:1] + lines[1:][-4:] if e.kind == "tool_result" else lines)
        return out
