"""Structured logging to stderr: one line per event, JSON when ``AGENTBOX_LOG_JSON=1``.

``log.info("task queued", task_id=…)`` writes the line structlog's console renderer
wrote (this module replaced structlog; ``tests/unit/test_log_format.py`` holds the two
side by side)::

    2026-12-02T11:31:06.353663Z [info     ] task queued                    task_id=t-…

an ISO UTC time, the level padded in brackets, the event padded to 30 columns, then
the fields sorted by key (a string as is unless it holds a space, quote, ``=`` or a
line break; anything else as its ``repr``), coloured when stderr is a terminal. With
``exc_info`` (:meth:`Logger.exception`), the traceback follows, plain (no locals).
JSON lines are the same fields in call order, then ``event``, ``level``, ``timestamp``.

Why not structlog itself: ``import structlog`` imports ``rich.traceback``,
``rich.pretty``, pygments and attrs to render the tracebacks of logged exceptions,
and asyncio. That was ~0.1 s of every ``agentbox run`` before its task was recorded,
and MiBs in each per-task process (gateway, VM monitor) that logs.
"""

from __future__ import annotations

import contextlib
import datetime
import json as _json
import logging
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any

__all__ = ["Logger", "configure", "get_logger"]

_configured = False
_min_level = logging.WARNING
_as_json = False
_colors = False

#: Level names padded to the longest structlog knew ("exception"), as its renderer did.
_LEVEL_WIDTH = 9
_EVENT_WIDTH = 30
_RESET, _BRIGHT, _DIM = "\033[0m", "\033[1m", "\033[2m"
_RED, _YELLOW, _GREEN, _CYAN, _MAGENTA = (f"\033[{n}m" for n in (31, 33, 32, 36, 35))
_LEVEL_COLOR = {"critical": _RED, "error": _RED, "warning": _YELLOW, "info": _GREEN,
                "debug": _GREEN}  # fmt: skip
#: What makes a string field print as its repr (so a line still splits into key=value).
_QUOTE = frozenset(" \t=\r\n\"'")


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Set the level (a :mod:`logging` name) and the format; may be called again."""
    global _configured, _min_level, _as_json, _colors
    _min_level = getattr(
        logging, (level or os.environ.get("AGENTBOX_LOG_LEVEL", "WARNING")).upper()
    )
    _as_json = json if json is not None else os.environ.get("AGENTBOX_LOG_JSON") == "1"
    _colors = not _as_json and _isatty()
    _configured = True


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (ValueError, AttributeError):  # closed, or no stderr at all
        return False


def get_logger(name: str) -> Logger:
    """A logger whose lines carry ``component=name``: the module's ``__name__``, less
    its ``agentbox.`` (``component=launcher._adopt``)."""
    if not _configured:
        configure()
    return Logger({"component": name.removeprefix("agentbox.")})


class Logger:
    """``debug``/``info``/``warning``/``error``/``critical(event, **fields)``.

    The level and format are read at each call (:func:`configure` may change them
    after the logger was made). A line below the level costs one comparison.
    """

    __slots__ = ("_context",)

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context

    def bind(self, **fields: Any) -> Logger:
        """A logger adding ``fields`` to every line."""
        return Logger({**self._context, **fields})

    def log(self, level: int, event: str, *args: Any, **fields: Any) -> None:
        """Log at a numeric :mod:`logging` level."""
        if level >= _min_level:
            self._emit(logging.getLevelName(level).lower(), event, args, fields)

    def debug(self, event: str, *args: Any, **fields: Any) -> None:
        if _min_level <= logging.DEBUG:
            self._emit("debug", event, args, fields)

    def info(self, event: str, *args: Any, **fields: Any) -> None:
        if _min_level <= logging.INFO:
            self._emit("info", event, args, fields)

    def warning(self, event: str, *args: Any, **fields: Any) -> None:
        if _min_level <= logging.WARNING:
            self._emit("warning", event, args, fields)

    warn = warning

    def error(self, event: str, *args: Any, **fields: Any) -> None:
        if _min_level <= logging.ERROR:
            self._emit("error", event, args, fields)

    def exception(self, event: str, *args: Any, **fields: Any) -> None:
        """``error`` with the exception being handled (``exc_info=True``)."""
        fields.setdefault("exc_info", True)
        self.error(event, *args, **fields)

    def critical(self, event: str, *args: Any, **fields: Any) -> None:
        if _min_level <= logging.CRITICAL:
            self._emit("critical", event, args, fields)

    def _emit(self, level: str, event: str, args: tuple[Any, ...], fields: dict[str, Any]) -> None:
        if args:
            one = len(args) == 1 and isinstance(args[0], Mapping) and args[0]
            event = event % (args[0] if one else args)
        line = {**self._context, **fields, "event": event, "level": level}
        line["timestamp"] = (
            datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        )
        text = _json.dumps(line, default=repr) if _as_json else _console(line, _colors)
        with contextlib.suppress(ValueError, OSError):  # a closed or broken stderr
            # The stderr of the moment, never one held since configure: a process that
            # configured logging while stderr was swapped (a test runner's capture, a
            # CLI runner) would write to a closed file. A log line never fails its work.
            print(text, file=sys.stderr, flush=True)


def _console(line: dict[str, Any], colors: bool) -> str:
    """One event as structlog's ``ConsoleRenderer`` laid it out."""
    reset, bright, dim, key, value = (
        (_RESET, _BRIGHT, _DIM, _CYAN, _MAGENTA) if colors else ("", "", "", "", "")
    )
    exc_info = line.pop("exc_info", None)
    level = line.pop("level")
    style = _LEVEL_COLOR.get(level, "") + bright if colors else ""
    cols = [
        f"{dim}{line.pop('timestamp')}{reset}",
        f"[{style}{level:<{_LEVEL_WIDTH}}{reset}]",
        f"{bright}{line.pop('event')!s:<{_EVENT_WIDTH}}{reset}",
    ]
    cols += [f"{key}{k}{reset}={value}{_value(line[k])}{reset}" for k in sorted(line)]
    text = " ".join(cols).rstrip(" ")
    exc = _exc_info(exc_info)
    if exc is not None:
        text += "\n" + "".join(traceback.format_exception(*exc)).rstrip("\n")
    return text


def _value(v: Any) -> str:
    if isinstance(v, str) and not (_QUOTE & set(v)):
        return v
    return repr(v)


def _exc_info(v: Any) -> tuple[Any, BaseException, Any] | None:
    """The exception ``exc_info=`` names: an exception, a ``sys.exc_info()`` tuple, or
    true for the one being handled."""
    if isinstance(v, BaseException):
        return (type(v), v, v.__traceback__)
    if isinstance(v, tuple) and len(v) == 3 and isinstance(v[1], BaseException):
        return (v[0], v[1], v[2])
    if v:
        exc = sys.exc_info()
        if exc[1] is not None:
            return (exc[0], exc[1], exc[2])
    return None
