"""The tutorial runner's extractor and its drift check (issue 13 section 5).

``tests/e2e/test_tutorials.py`` runs every tutorial's console blocks verbatim;
these tests pin the convention it reads (docs/tutorials/README.md) and prove a
doc that drifts from the CLI fails: a copy of a real tutorial with one command
mutated is caught, statically and when run by a real shell.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tutorial_runner import (
    StepFailed,
    agentbox_invocations,
    cli_drift,
    cli_error,
    expected_pattern,
    parse_tutorial,
    requirements,
    run_tutorial,
)

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted(p for p in (ROOT / "docs" / "tutorials").glob("*.md") if p.name != "README.md")


def test_there_are_tutorials() -> None:
    assert {p.name for p in TUTORIALS} >= {"first-task.md", "delegate-from-claude-code.md"}


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_a_tutorial_keeps_its_commands_in_console_blocks(path: Path) -> None:
    """Commands in a ``sh`` block would never be run by the test, so they may drift."""
    blocks = parse_tutorial(path.read_text())
    shell = [b.line for b in blocks if b.lang in ("sh", "bash", "shell", "zsh")]
    assert not shell, f"{path.name}: shell blocks at lines {shell}: use console with '# ' prompts"
    assert any(b.runs for b in blocks), f"{path.name} has no console block that runs"
    for b in blocks:
        if b.lang == "console" and b.not_run is None:
            assert b.commands, f"{path.name}:{b.line}: a console block without a prompt"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_every_agentbox_command_in_a_tutorial_parses(path: Path) -> None:
    """Shown or run, each ``agentbox …`` line must be one the CLI accepts."""
    assert cli_drift(path.read_text(), only_run=False) == []


def test_the_firecracker_reference_shows_commands_that_exist() -> None:
    text = (ROOT / "docs" / "reference" / "firecracker-backend.md").read_text()
    calls = [c for b in parse_tutorial(text) for line in b.body for c in agentbox_invocations(line)]
    assert [
        "run",
        "--backend",
        "firecracker",
        "--repo",
        "~/src/proj",
        "Fix the flaky test",
    ] in calls
    assert [(c, cli_error(c)) for c in calls if cli_error(c)] == []


def test_a_drifted_command_in_a_copy_of_a_tutorial_is_caught() -> None:
    text = (ROOT / "docs" / "tutorials" / "first-task.md").read_text()
    assert cli_drift(text) == []
    # One option renamed, one subcommand misspelt: each is named with its line.
    for good, bad, why in [
        ("--deadline", "--dedline", "No such option"),
        ("agentbox show", "agentbox shw", "no command 'shw'"),
    ]:
        assert good in text, good
        drifted = cli_drift(text.replace(good, bad, 1))
        assert len(drifted) == 1 and why in drifted[0], drifted
        line = text[: text.index(good)].count("\n") + 1
        assert drifted[0].startswith(f"line {line}:"), (drifted, line)


def test_the_parser_reads_prompts_continuations_heredocs_output_and_annotations() -> None:
    text = """\
<!-- requires: ray, podman -->
```console
# echo one \\
  two
one two
# cat > /tmp/x <<'EOF'
# not a prompt inside a here-document
EOF
$ true
…
```

<!-- not-run: needs a real key -->
```console
# agentbox run --model sonnet "x"
```

<!-- background -->

```console
# agentbox serve
agentbox is serving.
```

```sh
agentbox never run
```
"""
    blocks = parse_tutorial(text)
    assert [b.lang for b in blocks] == ["console", "console", "console", "sh"]
    first = blocks[0]
    assert [c.text for c in first.commands] == [
        "echo one \\\n  two",
        "cat > /tmp/x <<'EOF'\n# not a prompt inside a here-document\nEOF",
        "true",
    ]
    assert [c.line for c in first.commands] == [3, 6, 9]
    assert first.commands[0].expect == [(5, "one two")]
    assert first.commands[2].expect == []  # a bare … checks nothing
    assert blocks[1].not_run == "needs a real key" and not blocks[1].runs
    assert blocks[2].background and blocks[2].runs
    assert not blocks[3].runs
    assert requirements(text) == {"ray", "podman"}


def test_shown_output_matches_loosely() -> None:
    rx = expected_pattern("status     done")
    assert rx.search("status done") and rx.search("status\tdone  ")
    assert not rx.search("status failed")
    rx = expected_pattern("branch     agentbox/demo-…")
    assert rx.search("branch  agentbox/demo-20261201-1")
    assert expected_pattern("a (b) [c] $d").search("a (b) [c] $d")


def test_agentbox_calls_are_found_where_the_shell_runs_them() -> None:
    cmd = (
        'X=1 agentbox run --repo ~/p "fix it" && git log; '
        "claude mcp add agentbox -- agentbox mcp --user dev | cat; "
        'id=$(agentbox tasks --json) 2>/dev/null; groupadd agentbox; echo "agentbox show"'
    )
    assert agentbox_invocations(cmd) == [
        ["run", "--repo", "~/p", "fix it"],
        ["tasks", "--json"],
    ]
    assert agentbox_invocations("/opt/agentbox/.venv/bin/agentbox doctor > out") == [["doctor"]]


def _run(tmp_path: Path, text: str) -> object:
    work = tmp_path / "steps"
    work.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    return run_tutorial(
        tmp_path / "t.md", cwd=ROOT, env=env, workdir=work, text=text, timeout=120, output_wait=2.0
    )


def test_the_runner_runs_commands_in_one_shell_and_checks_output(tmp_path: Path) -> None:
    text = """\
```console
# . .venv/bin/activate
# cd /tmp && x=42
```

<!-- not-run: shown only -->
```console
# false
```

```console
# echo "$x in $(pwd)"
42 in /tmp
# agentbox models
…replay-demo…
```
"""
    run = _run(tmp_path, text)
    assert [rc for _, rc in run.ran] == [0, 0, 0, 0]  # type: ignore[attr-defined]
    assert [why for _, why in run.skipped] == ["shown only"]  # type: ignore[attr-defined]


def test_the_runner_fails_on_a_drifted_command_naming_its_line(tmp_path: Path) -> None:
    text = """\
```console
# . .venv/bin/activate
# agentbox models --jsn
```
"""
    with pytest.raises(StepFailed, match=r"t\.md:3: 'agentbox models --jsn' exited 2"):
        _run(tmp_path, text)


def test_the_runner_fails_when_shown_output_never_comes(tmp_path: Path) -> None:
    text = """\
```console
# echo status failed
status     done
```
"""
    with pytest.raises(StepFailed, match=r"t\.md:3: the tutorial shows 'status     done'"):
        _run(tmp_path, text)


def test_a_background_command_is_waited_for_and_stopped(tmp_path: Path) -> None:
    flag = tmp_path / "stopped"
    text = f"""\
<!-- background -->
```console
# trap 'touch {flag}; exit 0' TERM; sleep 0.5; echo ready; while :; do sleep 0.1; done
ready
```

```console
# echo after
after
```
"""
    run = _run(tmp_path, text)
    assert len(run.ran) == 2  # type: ignore[attr-defined]
    assert "ready" in run.transcript  # type: ignore[attr-defined]
    assert flag.exists()  # stopped (TERM) when the tutorial ended


def test_the_readme_commands_exist_and_parse() -> None:
    """README's two commands are scripts that exist; its agentbox lines parse."""
    text = (ROOT / "README.md").read_text()
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert script in text
        assert os.access(ROOT / script, os.X_OK), script
    calls = [c for b in parse_tutorial(text) for line in b.body for c in agentbox_invocations(line)]
    assert calls, "README shows no agentbox command"
    assert [(c, cli_error(c)) for c in calls if cli_error(c)] == []
