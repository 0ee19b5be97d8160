"""What the MCP tools answer, as text: task state, results and transcripts.

Text the sandboxed agent wrote (the report's final message and file names, the
diff, errors quoting them, the transcript) goes back to the host agent only inside
a framed block (:func:`agentbox.mcp._untrusted.frame`) that says it is data, not
instructions; paths that run code when the branch is opened or merged are listed
above it, as JSON strings.
"""

from __future__ import annotations

import json
import time
from typing import Any

from agentbox.launcher.api import NO_CHANGES, TaskInfo, TaskResult
from agentbox.mcp._fetch import branch_name
from agentbox.mcp._untrusted import frame
from agentbox.transcript import TranscriptPage, event_text

MAX_REPORT_CHARS = 16_000
#: The most characters of transcript text in one tool answer.
MAX_TRANSCRIPT_CHARS = 40_000


def _usd(cost: float | None) -> str:
    from agentbox.gateway import format_usd

    return format_usd(cost)


def info_dict(info: TaskInfo) -> dict[str, Any]:
    d = info.model_dump(mode="json")
    d["task"] = d["task"][:200]
    d["tokens_total"] = info.tokens.total
    # Dollars at the model's registry prices; None: the price is unknown (never $0).
    d["cost_usd"] = info.tokens.cost_usd
    if info.changed is False and info.status == "done":
        d["outcome"] = NO_CHANGES
    end = info.finished_at or time.time()
    d["elapsed_s"] = round(end - info.started_at, 1) if info.started_at else 0.0
    return d


STATE = "task state as JSON; its error and phase fields may quote what the agent wrote"


def info_json(info: TaskInfo) -> str:
    return frame(json.dumps(info_dict(info), indent=1), STATE)


def _flagged_text(report: dict[str, Any]) -> str:
    """The warning about paths that run code, for above the framed diff ("" if none)."""
    flagged = report.get("flagged")
    if not isinstance(flagged, list) or not flagged:
        return ""
    lines = [
        f"WARNING: this result changes {len(flagged)} path(s) that make other tools run code "
        "when the branch is opened, checked out or merged. Tell the user and review them "
        "before checking the branch out or merging it (names as JSON strings, chosen by the "
        "sandboxed agent):"
    ]
    for f in flagged[:100]:
        if isinstance(f, dict):
            path = json.dumps(str(f.get("path", "?")))
            lines.append(f"  {f.get('change', '?')} {path}: {f.get('reason', '')}")
    return "\n".join(lines) + "\n"


def format_result(info: TaskInfo, res: TaskResult, fetched: str, max_diff: int) -> str:
    report = json.dumps(res.report, indent=1, default=str)
    if len(report) > MAX_REPORT_CHARS:
        report = report[:MAX_REPORT_CHARS] + f"\n[report truncated at {MAX_REPORT_CHARS} chars]"
    diff = res.diff
    note = ""
    if len(diff) > max_diff:
        note = (
            f"\n[diff truncated: showing {max_diff} of {len(diff)} characters; the full change "
            f"is on branch {branch_name(info.id)}: git diff {branch_name(info.id)}~1 "
            f"{branch_name(info.id)}]"
        )
        diff = diff[:max_diff]
    elif res.diff_truncated:
        note = f"\n[diff truncated by the launcher; see branch {branch_name(info.id)}]"
    head = (
        f"task {info.id}: {res.status} (exit code {info.exit_code}), "
        f"{info.tokens.total} tokens ({_usd(info.tokens.cost_usd)}); "
        f"{_tests_word(res.report)}\n{_used_line(res.report)}{fetched}\n"
    )
    error = f"error: {info.error}\n\n" if info.error else ""
    body = f"{error}report:\n{report}\n\ndiff:\n{diff or '(no changes)'}\n"
    what = "the task's report (with the agent's final message) and the diff of its files"
    return f"{head}{_flagged_text(res.report)}\n{frame(body, what)}{note.lstrip()}\n"


def _used_line(report: dict[str, Any]) -> str:
    """What the sandbox used, measured by the launcher ("" if not measured)."""
    from agentbox.observe.resources import resources_words

    words = resources_words(report.get("resources"))
    return f"resources: {words}\n" if words else ""


def _tests_word(report: dict[str, Any]) -> str:
    """Whether the agent ran tests and how they exited (no agent text: the command is
    in the framed report)."""
    ltc = report.get("last_test_command")
    if not isinstance(ltc, dict):
        return "tests: none run (the agent ran no test command)"
    code = ltc.get("exit_code")
    if not isinstance(code, int):
        return "tests: ran, exit code unknown (see last_test_command in the report)"
    word = "passed" if code == 0 else "FAILED"
    return f"tests: {word} (exit {code}; the command is last_test_command in the report)"


def transcript_text(page: TranscriptPage, *, tail_lines: int) -> str:
    """A page of the transcript: counts outside, every event inside a framed block."""
    start = page.next - len(page.events)
    parts: list[str] = []
    size = 0
    for e in page.events:
        line = event_text(e, tail_lines=tail_lines)
        if size + len(line) > MAX_TRANSCRIPT_CHARS:
            break
        parts.append(line)
        size += len(line) + 1
    nxt = start + len(parts)
    more = (
        f"call transcript with since={nxt} for the next ones"
        if nxt < page.total
        else "no more events yet"
    )
    head = (
        f"transcript of task {page.task_id}: events {start}..{max(start, nxt - 1)} of "
        f"{page.total} ({more}); tools run: {sum(page.tools_run.values())}; "
        f"tokens metered by the gateway: {page.tokens.total}\n"
    )
    what = "the task's transcript: the agent's commands, their output and its messages"
    return head + frame("\n".join(parts) or "(no events)", what)
