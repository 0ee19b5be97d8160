"""``agentbox diff --stat`` of a truncated diff gives the whole result's totals (issue 33
§7: a 200,011-file result was shown as "1 file(s) changed")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import agentbox.cli._diff as diff_cli

DIFF = "diff --git a/f0 b/f0\nnew file mode 100644\n--- /dev/null\n+++ b/f0\n@@ -0,0 +1 @@\n+x\n"


class _Done:
    def result(self, tid: str) -> Any:
        report = {"diffstat": {"files_changed": 200011, "insertions": 200011, "deletions": 3}}
        return SimpleNamespace(diff=DIFF, diff_truncated=True, report=report)

    def close(self, wait: bool = True) -> None:
        pass


def test_stat_of_a_truncated_diff_says_the_real_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diff_cli, "in_process", lambda *a, **k: _Done())
    app = typer.Typer()
    diff_cli.register(app)
    res = CliRunner().invoke(app, ["diff", "t-1", "--stat"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "200011 file(s) changed, 200011 insertion(s), 3 deletion(s)" in res.output
    assert not any(ln.startswith("1 file(s)") for ln in res.output.splitlines())
