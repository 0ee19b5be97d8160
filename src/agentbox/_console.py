"""Module-level rich consoles, made again when the process's streams change.

A ``rich.console.Console`` decides colour, terminal-ness and width from the streams
and the environment it sees when it is *made*. A module that makes one at import
time and runs in a fork of the front-end server (:mod:`agentbox.front`) made it for
the server's streams, not the caller's terminal: every module-level console is made
by :func:`console` instead, and :func:`remake_all` makes each again, in place
(so names bound by ``from … import console`` see it too).
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
    return made


def remake_all() -> None:
    """Every console made by :func:`console`, made again for today's streams and
    environment; rich's own global console forgotten."""
    import rich

    for made, options in list(_MADE.items()):
        made.__init__(**options)  # type: ignore[misc]
    rich._console = None
