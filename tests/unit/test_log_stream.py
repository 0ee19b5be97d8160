"""Logging writes to the stderr of the moment and never raises from a log call."""

from __future__ import annotations

import io
import sys

import pytest

from agentbox.core import log as _log


def test_a_log_line_goes_to_the_current_stderr_not_the_one_at_configure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    _log.configure("INFO")
    first.close()  # a test runner's capture stream, gone after its test
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    _log.get_logger("t").warning("after the swap", n=1)
    assert "after the swap" in second.getvalue()


def test_a_closed_stderr_drops_the_line_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    _log.configure("INFO")
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    _log.get_logger("t").error("nobody reads this")  # must not raise ValueError
