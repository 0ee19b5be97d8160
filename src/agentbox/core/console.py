"""Module-level rich consoles, made again when the process's streams change.

A ``rich.console.Console`` decides colour, terminal-ness and width from the streams
and the environment it sees when it is *made*. A module that makes one at import
time and runs in a fork of the front-end server (:mod:`agentbox.front`) made it for
the server's streams, not the caller's terminal: every module-level console is made
by :func:`console` instead, and :func:`remake_all` makes each again, in place
(so names bound by ``from … import console`` see it too). Made for a stream that is
not a terminal, a console does not break lines at its width (:func:`_unwrapped`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["console", "remake_all"]

_MADE: weakref.WeakKeyDictionary[Console, dict[str, Any]] = weakref.WeakKeyDictionary()


def console(**options: Any) -> Console:
    """``rich.console.Console(**options)``, remade by :func:`remake_all`."""
    from rich.console import Console

    made = Console(**options)
    _MADE[made] = options
    _unwrapped(made, options)
    return made


def _unwrapped(made: Console, options: dict[str, Any]) -> None:
    """Not on a terminal (a pipe, a file), a printed line is never broken at the
    console's width (80 columns) mid-phrase: a long line stays one line (its soft wrap,
    unless ``options`` chose one). Tables lay themselves out: :mod:`agentbox.cli._table`."""
    if "soft_wrap" not in options and not made.is_terminal:
        made.soft_wrap = True


def remake_all() -> None:
    """Every console made by :func:`console`, made again for today's streams and
    environment; rich's own global console forgotten."""
    import rich

    for made, options in list(_MADE.items()):
        made.__init__(**options)  # type: ignore[misc]
        _unwrapped(made, options)
    rich._console = None
