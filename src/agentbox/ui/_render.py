"""The web view's pages: Jinja2 templates with autoescape on, fed only plain data.

Everything a task holds came from the agent or is about it (task text, transcript, diff,
report, paths): it is shown as text. Autoescape turns markup into text; ``visible``
shows control characters (ANSI sequences, bidi overrides) as escapes; nothing is linked
but the view's own pages, so no agent-written URL becomes clickable and no image it
names is fetched.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from agentbox.core.text import visible
from agentbox.transcript import Event

ENV = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
)
ENV.filters["v"] = visible

#: Columns the list sorts by: (key, label).
SORTS = (("-created", "newest first"), ("created", "oldest first"), ("status", "status"),
         ("-tokens", "most tokens"), ("-cost", "most cost"))  # fmt: skip
MAX_DIFF_LINES = 20_000
MAX_BODY = 20_000


def render(name: str, **data: Any) -> str:
    return ENV.get_template(f"{name}.html").render(**data)


def when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "?"


def money(v: float | None) -> str:
    return "price unknown" if v is None else f"${v:.4f}"


def task_view(info: Any, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """A task's plain fields for the pages (every string passed through ``visible``)."""
    tokens = info.tokens
    end = info.finished_at or time.time()
    tests = "-"
    last = (report or {}).get("last_test_command")
    if isinstance(last, dict):
        code = last.get("exit_code")
        tests = "not returned" if code is None else ("passed" if code == 0 else f"failed ({code})")
    flagged = (report or {}).get("flagged")
    from agentbox.observe.resources import resources_words

    used = resources_words((report or {}).get("resources") or getattr(info, "resources", None))
    return {
        "resources": visible(used or ""),
        "id": info.id,
        "group": getattr(info, "group", None),
        "status": info.status,
        "text": visible(info.task[:300] + ("…" if len(info.task) > 300 else "")),
        "model": visible(info.model),
        "repo": visible(info.repo),
        "created": when(info.created_at),
        "elapsed": f"{max(0.0, end - info.created_at):.1f}s",
        "tokens": f"{tokens.total:,}",
        "cost": money(tokens.cost_usd),
        "tests": tests,
        "flagged": len(flagged) if isinstance(flagged, list) else 0,
        "branch": visible(info.branch or ""),
        "error": visible(info.error or ""),
        "running": info.status in ("queued", "running"),
        "finished": info.status in ("done", "failed", "timed_out", "cancelled"),
        "publishable": info.status in ("done", "failed", "timed_out", "cancelled")
        and info.changed is True
        and not info.branch,
    }


def event_view(e: Event) -> dict[str, Any]:
    """One transcript event as the page shows it (``agentbox logs``' wording)."""
    label = e.tool or {"phase": "launcher", "refusal": "gateway refused", "error": "error"}.get(
        e.kind, "agent"
    )
    head = ""
    body = ""
    summary = ""
    if e.kind == "tool_call":
        head = visible(f"$ {e.input}" if e.tool == "Bash" else (e.input or ""))[:MAX_BODY]
    elif e.kind == "tool_result":
        status = f"exit {e.exit_code}" if e.exit_code is not None else (
            "error" if e.is_error else "ok")  # fmt: skip
        if e.written_lines is not None:
            status += f" (wrote {e.written_lines} lines)"
        label = f"↳ {e.tool or '?'} {status}"
        body = visible(e.text)[-MAX_BODY:]
        n = len(e.text.splitlines())
        summary = f"output: {n} line{'' if n == 1 else 's'}"
    else:
        head = visible(e.text)[:MAX_BODY]
    return {"seq": e.seq, "kind": e.kind, "when": clock(e.time), "label": label, "head": head,
            "body": body, "summary": summary, "open": False}  # fmt: skip


_DIFF_FILE = re.compile(r"^diff --git a/(.*) b/(.*)$")


def diff_view(diff: str) -> list[dict[str, Any]]:
    """The diff by file, each line with its class (added, removed, hunk, meta)."""
    files: list[dict[str, Any]] = []
    for raw in diff.splitlines()[:MAX_DIFF_LINES]:
        line = visible(raw)
        m = _DIFF_FILE.match(raw)
        if m or not files:
            files.append({"name": visible(m.group(2)) if m else "(diff)", "lines": []})
        cls = (
            "meta" if m or raw.startswith(("index ", "--- ", "+++ ", "new file", "deleted file"))
            else "hunk" if raw.startswith("@@")
            else "add" if raw.startswith("+")
            else "del" if raw.startswith("-")
            else "ctx"
        )  # fmt: skip
        files[-1]["lines"].append((cls, line))
    return files


def report_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's scalar fields and its setup and egress summaries, as text rows."""
    rows: list[tuple[str, str]] = []
    for key in ("status", "exit_code", "duration_s", "backend", "runtime", "final_message",
                "error", "changed"):  # fmt: skip
        v = report.get(key)
        if v is not None and v != "":
            rows.append((key, visible(str(v))[:MAX_BODY]))
    last = report.get("last_test_command")
    if isinstance(last, dict):
        rows.append(("last test", visible(f"{last.get('command')} → exit {last.get('exit_code')}")))
    setup = report.get("setup")
    if isinstance(setup, dict):
        facts = ", ".join(f"{k} {v}" for k, v in setup.items() if isinstance(v, str | int | float))
        rows.append(("setup", visible(facts[:2000])))
        tail = setup.get("output_tail")
        if isinstance(tail, str) and tail:
            rows.append(("setup output", visible(tail[-4000:])))
    egress = report.get("egress")
    if isinstance(egress, dict):
        rows.append(
            ("egress", f"allowed {egress.get('allowed', 0)}, refused {egress.get('denied', 0)}")
        )
    return rows


def group_rows(view: Any) -> list[dict[str, Any]]:
    """A best-of-N group's attempts as the comparison table shows them."""
    rows = []
    for a in view.attempts:
        tests = "not run" if a.tests_passed is None else ("passed" if a.tests_passed else
                                                          f"failed ({a.test_exit})")  # fmt: skip
        rows.append({
            "attempt": a.attempt, "id": a.id, "status": a.status, "tests": tests,
            "diff_lines": a.diff_lines, "files": a.files_changed, "flagged": a.flagged,
            "tokens": f"{a.tokens.total:,}", "cost": money(a.cost_usd),
            "time": "-" if a.duration_s is None else f"{a.duration_s:.1f}s",
            "picked": a.attempt == view.pick,
        })  # fmt: skip
    return rows


def batch_view(meta: dict[str, Any], rows: list[Any], committed: int) -> dict[str, Any]:
    """A batch's page: per node (tasks, done, failed, running, tokens, cost) and per task."""
    nodes: dict[str, dict[str, Any]] = {}
    for r in rows:
        n = nodes.setdefault(r.node or "-", {"node": visible(r.node or "-"), "tasks": 0,
                                             "done": 0, "failed": 0, "running": 0,
                                             "tokens": 0, "usd": 0.0, "priced": True})  # fmt: skip
        n["tasks"] += 1
        n["tokens"] += r.tokens
        if r.status == "done":
            n["done"] += 1
        elif r.status:
            n["failed"] += 1
        else:
            n["running"] += 1
        if r.status and r.cost_usd is None:
            n["priced"] = False
        n["usd"] += r.cost_usd or 0.0
    for n in nodes.values():
        n["cost"] = money(n["usd"] if n["priced"] else None)
        n["tokens"] = f"{n['tokens']:,}"
    return {
        "id": visible(str(meta.get("id", ""))),
        "created": when(
            meta.get("created_at") if isinstance(meta.get("created_at"), float | int) else None
        ),
        "cancel": bool(meta.get("cancel_requested")),
        "committed": f"{committed:,}",
        "nodes": sorted(nodes.values(), key=lambda n: str(n["node"])),
        "rows": [
            {
                "key": visible(r.key),
                "state": visible(r.state),
                "status": visible(r.status or "-"),
                "node": visible(r.node or "-"),
                "tokens": f"{r.tokens:,}",
                "cost": money(r.cost_usd) if r.status else "-",
                "branch": visible(r.branch or "-"),
                "error": visible(r.error[:300]),
            }
            for r in rows
        ],
    }
