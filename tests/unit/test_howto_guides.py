"""The how-to guides are held to the tutorials' convention (issue 34 item 10).

``tests/e2e/test_tutorials.py::test_the_how_to_guide_runs_verbatim`` runs each guide's
console blocks; here, in seconds and without running anything: a guide keeps its
commands in console blocks (a ``sh`` block would never be run, so it could drift), a
block that does not run says why, and every ``agentbox …`` shown, run or not, parses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tutorial_runner import cli_drift, parse_tutorial

ROOT = Path(__file__).resolve().parents[2]
HOWTOS = sorted((ROOT / "docs" / "how-to").glob("*.md"))


def test_there_are_how_to_guides() -> None:
    assert {p.name for p in HOWTOS} >= {"operate.md", "run-under-gvisor.md"}


@pytest.mark.parametrize("path", HOWTOS, ids=lambda p: p.name)
def test_a_guide_keeps_its_commands_in_console_blocks(path: Path) -> None:
    blocks = parse_tutorial(path.read_text())
    shell = [b.line for b in blocks if b.lang in ("sh", "bash", "shell", "zsh")]
    assert not shell, f"{path.name}: shell blocks at lines {shell}: use console with '# ' prompts"
    for b in blocks:
        if b.lang != "console":
            continue
        assert b.commands, f"{path.name}:{b.line}: a console block without a prompt"
        if b.not_run is not None:
            assert b.not_run.strip() and b.not_run != "marked not-run", (
                f"{path.name}:{b.line}: say why the block does not run"
            )


@pytest.mark.parametrize("path", HOWTOS, ids=lambda p: p.name)
def test_every_agentbox_command_in_a_guide_parses(path: Path) -> None:
    assert cli_drift(path.read_text(), only_run=False) == []


def test_some_guides_run() -> None:
    """At least the cheap checks of operate, dependencies, local models and gVisor run."""
    running = {p.name for p in HOWTOS if any(b.runs for b in parse_tutorial(p.read_text()))}
    assert running >= {"operate.md", "run-under-gvisor.md"}, running
