"""The code speaks of itself, not of the tracker: no source file under ``src/agentbox``
names an issue number (history and issue numbers belong in CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

import agentbox

SRC = Path(agentbox.__file__).parent
# "issue 18", "Issue #7", "issues 11 and 12": a tracker reference in prose or a comment.
_TRACKER = re.compile(r"\b[Ii]ssues? #?\d+")


def test_no_source_file_names_a_tracker_issue() -> None:
    hits = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _TRACKER.search(line)
    ]
    assert hits == [], "\n".join(hits)


def test_the_pattern_finds_a_reference() -> None:
    assert _TRACKER.search("measured in issue 18 item 4")
    assert _TRACKER.search("(Issue #7)")
    assert not _TRACKER.search("an issue with the socket")
