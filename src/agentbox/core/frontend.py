"""The front end's names, shared by its client (:mod:`agentbox.front`) and the launcher
service that keeps its server (:mod:`agentbox.launcher._front`). Standard library
only, and nothing of it: the client imports this before every command."""

from __future__ import annotations

import os

__all__ = ["ENV", "SOCKET_NAME", "mode"]

#: The server's socket, in the launcher's ``<data_dir>/run/`` directory.
SOCKET_NAME = "front.sock"
#: ``auto`` | ``off`` | ``require``.
ENV = "AGENTBOX_FRONT_END"


def mode() -> str:
    """``AGENTBOX_FRONT_END`` as ``auto``, ``off`` or ``require`` (unknown words: ``auto``)."""
    word = os.environ.get(ENV, "auto").strip().lower()
    if word in ("off", "0", "no", "false"):
        return "off"
    return "require" if word == "require" else "auto"
