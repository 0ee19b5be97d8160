"""``agentbox show``'s setup and egress lines: read defensively, printed through the sanitizer."""

from __future__ import annotations

from typing import Any

import pytest

from agentbox.cli._env import env_rows, setup_tail
from agentbox.core.text import visible


def test_rows_for_a_miss_with_egress_and_an_agent_egress() -> None:
    report: dict[str, Any] = {
        "setup": {
            "cache": "miss",
            "duration_s": 41.0,
            "roots": [".venv", "~/.cache/tool"],
            "files": 2511,
            "size": 35_382_336,
            "egress": {
                "allowed": 2,
                "denied": 1,
                "hosts": [{"host": "pypi.org", "allowed": 2, "denied": 0, "bytes_down": 2 << 20}],
            },
        },
        "egress": {"allowed": 0, "denied": 3, "hosts": [{"host": "evil.example", "denied": 3}]},
    }
    rows = dict(env_rows(report))
    assert rows["setup"] == (
        "ran and frozen (cache miss) in 41.0s: .venv, ~/.cache/tool · 2,511 files, 33.7 MiB"
    )
    assert rows["setup egress"].startswith("2 allowed, 1 denied: pypi.org (2 allowed, 0 denied")
    assert rows["egress"] == "0 allowed, 3 denied: evil.example (0 allowed, 3 denied, 0 B in)"
    assert setup_tail(report) is None


def test_a_failed_setup_shows_its_tail_sanitized() -> None:
    report = {"setup": {"cache": "failed", "exit_code": 7, "output_tail": "boom\x1b]52;c;x\x07"}}
    assert dict(env_rows(report))["setup"] == "FAILED (exit 7)"
    tail = setup_tail(report)
    assert tail is not None and "\x1b" not in visible(tail)


@pytest.mark.parametrize(
    "report",
    [
        {},
        {"setup": None},
        {"setup": {"cache": 5, "roots": "x", "files": "many", "egress": []}},
        {"setup": {"cache": "hit", "roots": [1, None]}, "egress": {"hosts": [1, "x", None]}},
        {"setup": {"cache": "failed", "output_tail": 12}},
    ],
)
def test_malformed_reports_never_raise(report: dict[str, Any]) -> None:
    for _label, text in env_rows(report):
        assert isinstance(text, str)
    setup_tail(report)
