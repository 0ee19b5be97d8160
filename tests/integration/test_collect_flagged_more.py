"""The paths issue 33 §8 adds are flagged through a real collection (walk, commit,
report): each file below is written by the "agent" and must come out in
``Report.flagged`` with its reason; an ordinary neighbour must not."""

from __future__ import annotations

from pathlib import Path

from test_collect_support import make_repo, prepare_in

from agentbox.collect import Report, collect

FLAGGED = {
    ".lfsconfig": "makes git contact a server",
    ".vscode/launch.json": "launch",
    "team.code-workspace": "workspace",
    ".idea/runConfigurations/Server.xml": "run configuration",
    ".idea/workspace.xml": "run configuration",
    ".run/App.run.xml": "run configuration",
    "mise.toml": "mise",
    "svc/.mise.toml": "mise",
    ".yarnrc.yml": "yarnPath",
    ".npmrc": "script-shell",
    ".tool-versions": "asdf",
    ".python-version": "pyenv",
    ".env": "direnv",
}


def test_the_new_flagged_paths_reach_the_report(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"README.md": "hi\n"})
    p = prepare_in(tmp_path / "task", repo)
    for rel in [*FLAGGED, "docs/mise.md", ".env.example"]:
        (p.ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (p.ws / rel).write_text("x = 1\n")
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m")
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    reasons = {f.path: f.reason for f in report.flagged}
    assert set(reasons) == set(FLAGGED), reasons
    for path, words in FLAGGED.items():
        assert words in reasons[path], (path, reasons[path])
    assert {f.change for f in report.flagged} == {"added"}
