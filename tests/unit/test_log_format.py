"""Our log lines are the lines structlog wrote (the oracle: structlog configured as
``agentbox.core.log`` configured it before it stopped importing structlog), and logging
imports neither structlog nor rich (issue 15: ~0.1 s before a task is recorded)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.core import log as _log

structlog = pytest.importorskip("structlog")

#: The ISO time that starts a line (with or without the renderer's colour around it).
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z")

#: (method, event, positional args, fields): what our code logs, and the edge cases.
CALLS: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = [
    ("info", "task queued", (), {"task_id": "t-1", "repo": "/r/x", "caller": None}),
    ("warning", "orphan sweep failed", (), {"error": "podman: exit 125\nno such container"}),
    ("error", "an event longer than the thirty columns it is padded to", (), {}),
    ("debug", "short", (), {}),
    ("critical", "k=v", (), {"a": "x=y", "b": "it's", "c": "", "d": 'say "hi"', "e": "tab\t"}),
    ("info", "types", (), {"n": 3, "f": 0.5, "l": [1, "a"], "d": {"k": 1}, "p": Path("/a b")}),
    ("info", "%s of %d", ("two", 3), {"z": 1, "a": 2}),
    ("info", "%(x)s", ({"x": "mapped"},), {}),
    ("warning", "", (), {"component": "overridden"}),
]


@pytest.fixture
def oracle() -> Iterator[Callable[..., str]]:
    """``configure(colors=…, json=…)`` → a function logging one call through structlog."""

    def make(*, colors: bool = False, as_json: bool = False) -> Callable[..., str]:
        renderer = (
            structlog.processors.JSONRenderer()
            if as_json
            else structlog.dev.ConsoleRenderer(
                colors=colors, exception_formatter=structlog.dev.plain_traceback
            )
        )
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(0),
            logger_factory=structlog.ReturnLoggerFactory(),
            cache_logger_on_first_use=False,
        )

        def call(method: str, event: str, *args: Any, **fields: Any) -> str:
            out: str = getattr(structlog.get_logger().bind(component="t"), method)(
                event, *args, **fields
            )
            return out

        return call

    yield make
    structlog.reset_defaults()


def _ours(capsys: pytest.CaptureFixture[str], method: str, event: str, *a: Any, **kw: Any) -> str:
    capsys.readouterr()
    getattr(_log.get_logger("t"), method)(event, *a, **kw)
    err = capsys.readouterr().err
    assert err.endswith("\n")
    return err[:-1]


@pytest.mark.parametrize("colors", [False, True])
def test_console_lines_are_structlogs(
    colors: bool, oracle: Callable[..., Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    want = oracle(colors=colors)
    _log.configure("DEBUG", json=False)
    monkeypatch.setattr(_log, "_colors", colors)  # capsys' stderr is no terminal
    for method, event, args, fields in CALLS:
        ours = _ours(capsys, method, event, *args, **fields)
        theirs = want(method, event, *args, **fields)
        assert _TIME.sub("TIME", ours) == _TIME.sub("TIME", theirs), (method, event)
        assert _TIME.search(ours)


def test_a_logged_exception_has_structlogs_plain_traceback(
    oracle: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    want = oracle()
    _log.configure("DEBUG", json=False)
    try:
        raise ValueError("no good")
    except ValueError as exc:
        ours = _ours(capsys, "exception", "failed", task_id="t-1")
        theirs = want("exception", "failed", task_id="t-1")
        given = _ours(capsys, "warning", "given", exc_info=exc)
        given_theirs = want("warning", "given", exc_info=exc)
    assert "ValueError: no good" in ours and "Traceback (most recent call last)" in ours
    assert _TIME.sub("T", ours) == _TIME.sub("T", theirs)
    assert _TIME.sub("T", given) == _TIME.sub("T", given_theirs)
    assert "\n" not in _ours(capsys, "error", "none", exc_info=True)  # nothing being handled


def test_json_lines_are_structlogs(
    oracle: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    want = oracle(as_json=True)
    _log.configure("DEBUG", json=True)
    for method, event, args, fields in CALLS:
        ours = json.loads(_ours(capsys, method, event, *args, **fields))
        theirs = json.loads(want(method, event, *args, **fields))
        assert _TIME.fullmatch(ours.pop("timestamp"))
        theirs.pop("timestamp")
        assert list(ours.items()) == list(theirs.items()), (method, event)


def test_the_level_filters_and_may_change_after_a_logger_was_made(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = _log.get_logger("t")
    _log.configure("WARNING", json=False)
    log.info("hidden")
    log.debug("hidden")
    log.warning("shown")
    _log.configure("DEBUG")
    log.debug("now shown")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "shown" in err and "now shown" in err


def test_logging_imports_neither_structlog_nor_rich() -> None:
    code = (
        "import sys\n"
        "from agentbox.core import log as _log\n"
        "_log.configure('DEBUG')\n"
        "_log.get_logger('t').info('a line', n=1)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "a line" in out.stderr  # the control: it logged
    mods = set(out.stdout.split())
    assert "agentbox.core.log" in mods
    heavy = sorted(m for m in mods if m.split(".")[0] in ("structlog", "rich", "pygments"))
    assert heavy == []
