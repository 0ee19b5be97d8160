"""Structured logging: structlog to stderr, JSON when ``AGENTBOX_LOG_JSON=1``."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import structlog

_configured = False


class _StderrLogger:
    """Writes each line to the *current* ``sys.stderr``, never a stream captured earlier.

    ``PrintLoggerFactory(file=sys.stderr)`` binds the stream at configure time: a process
    that configured logging while stderr was swapped (a test runner's capture, a CLI runner)
    then writes to a closed file and raises from a log call. A log line must never fail
    the work it describes: a closed or broken stderr drops the line.
    """

    def msg(self, message: str) -> None:
        with contextlib.suppress(ValueError, OSError):  # a closed or broken stderr
            print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _stderr_logger(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog once; later calls only change the level."""
    global _configured
    lvl = getattr(logging, (level or os.environ.get("AGENTBOX_LOG_LEVEL", "WARNING")).upper())
    as_json = json if json is not None else os.environ.get("AGENTBOX_LOG_JSON") == "1"
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> Any:
    """A structlog logger bound to ``component=name``."""
    if not _configured:
        configure()
    return structlog.get_logger().bind(component=name)
