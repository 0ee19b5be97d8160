"""``agentbox resume`` shows the flagged paths of the branch it continues, before it starts
(issue 33 §6): the new agent's Claude Code reads that branch's .claude/ settings."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import agentbox.cli._client as client
import agentbox.cli._run as run_cli

FLAGGED = [
    {"change": "added", "path": ".claude/settings.json", "reason": "Claude Code settings"},
    {"change": "added", "path": ".lfsconfig", "reason": "makes git contact a server"},
]


class _Prev:
    def get(self, tid: str) -> Any:
        return SimpleNamespace(id=tid, repo="/srv/repos/r", model="replay-demo")

    def result(self, tid: str) -> Any:
        return SimpleNamespace(report={"flagged": FLAGGED})

    def close(self, wait: bool = True) -> None:
        pass


def test_resume_shows_the_flagged_paths_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(client, "in_process", lambda *a, **k: _Prev())

    def foreground(req: Any, box: Any, **kw: Any) -> None:
        seen.append(f"started {req.continue_from}")

    monkeypatch.setattr(run_cli, "_foreground", foreground)
    app = typer.Typer()
    app.command("noop")(lambda: None)
    run_cli.register(app)
    res = CliRunner().invoke(app, ["resume", "t-prev", "go on"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert seen == ["started t-prev"]
    out = res.output
    assert "added .claude/settings.json" in out and "added .lfsconfig" in out
    assert "WARNING" in out
