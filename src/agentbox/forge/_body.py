"""A pull request's title and body, from a finished task's report.

The body says what a reviewer needs before opening the diff: the request, the
agent's own summary, the tests it ran and how they ended, the tokens and cost,
the files that make another tool run code when the branch is checked out or
merged, and how to read the transcript (on the host that ran it).

Everything the agent chose (its final message, file names) is text a forge
would render: markdown, HTML, ``@mentions`` that notify people, images that
load a URL. So it goes in as literal text only, inside a fenced code block
whose fence is longer than any backtick run in it, and file names as inline
code the same way; the body is cut to what every forge takes (GitHub: 65,536
characters).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from typing import Any

from agentbox.collect.report import tests_line
from agentbox.core.text import visible

#: GitHub refuses a body over 65,536 characters; GitLab takes 1,048,576. Room for the tail.
MAX_BODY = 60_000
_MAX_MESSAGE = 20_000
_TICKS = re.compile(r"`+")


def _fenced(text: str) -> str:
    """``text`` as a fenced code block nothing inside can close."""
    longest = max((len(m) for m in _TICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _code(text: str) -> str:
    """``text`` as inline code (one line), a backtick run in it cannot end it early."""
    text = " ".join(text.split())
    longest = max((len(m) for m in _TICKS.findall(text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def pr_title(task: str, task_id: str) -> str:
    """The request's first line (cut to 72 characters), tagged with the task id."""
    first = next((ln.strip() for ln in visible(task).splitlines() if ln.strip()), "")
    first = " ".join(first.split())
    if len(first) > 72:
        first = first[:71].rstrip() + "…"
    return f"{first or 'agentbox result'} [agentbox {task_id}]"


def _tokens(tokens: Mapping[str, Any]) -> str:
    def n(key: str) -> int:
        v = tokens.get(key)
        return v if isinstance(v, int) else 0

    total = n("input") + n("output") + n("cache_creation") + n("cache_read")
    cost = tokens.get("cost_usd")
    price = f"${cost:.4f}" if isinstance(cost, int | float) else "unknown (no price for the model)"
    return (
        f"{total:,} (input {n('input'):,}, output {n('output'):,}, cache write "
        f"{n('cache_creation'):,}, cache read {n('cache_read'):,}); cost {price}"
    )


def pr_body(report: Mapping[str, Any], *, task: str, task_id: str, host: str | None = None) -> str:
    """The markdown body of the pull request for task ``task_id`` (``report``: its
    ``report.json`` as loaded; ``task``: the request it was given)."""
    where = host or socket.gethostname()
    lines = [f"Opened by agentbox from task `{task_id}`, run in a sandbox on `{where}`.", ""]
    lines += ["### Request", "", _fenced(visible(task)[:4000]), ""]
    message = report.get("final_message")
    lines += ["### Summary (the agent's final message)", ""]
    if isinstance(message, str) and message.strip():
        text = visible(message.strip())
        if len(text) > _MAX_MESSAGE:
            text = text[:_MAX_MESSAGE] + "\n[… cut]"
        lines.append(_fenced(text))
    else:
        lines.append("The agent left no final message.")
    lines.append("")
    test = report.get("last_test_command")
    lines += ["### Tests", "", f"- {_code(tests_line(test if isinstance(test, dict) else None))}"]
    lines.append("")
    tokens = report.get("tokens")
    status = report.get("status")
    model = report.get("model")
    lines += [
        "### Task",
        "",
        f"- status: {_code(str(status))}" + (f", model {_code(str(model))}" if model else ""),
        f"- tokens: {_tokens(tokens if isinstance(tokens, dict) else {})}",
    ]
    diffstat = report.get("diffstat")
    if isinstance(diffstat, dict):
        d = {k: diffstat.get(k, "?") for k in ("files_changed", "insertions", "deletions")}
        lines.append(f"- changes: {d['files_changed']} files, +{d['insertions']} -{d['deletions']}")
    lines.append("")
    flagged = [f for f in report.get("flagged") or () if isinstance(f, dict)]
    lines += ["### Files that run code when the branch is checked out or merged", ""]
    if flagged:
        lines.append("Review these before you check the branch out or merge it:")
        lines.append("")
        for f in flagged[:200]:
            path, change = str(f.get("path", "")), str(f.get("change", ""))
            lines.append(f"- {change} {_code(visible(path))}: {visible(str(f.get('reason', '')))}")
    else:
        lines.append("None.")
    lines.append("")
    lines += [
        "### Transcript",
        "",
        f"Every command the agent ran and what came back: `agentbox logs {task_id}` on "
        f"`{where}` (`--full` for whole outputs); the report: `agentbox show {task_id}`.",
    ]
    body = "\n".join(lines) + "\n"
    if len(body) > MAX_BODY:
        body = body[: MAX_BODY - 40] + "\n\n[… the report was cut here]\n"
    return body
