"""``agentbox ui``: a local web view of this user's tasks.

Server-rendered pages (no build step) over the launcher's socket, on 127.0.0.1 only,
behind a login link with a fresh token: the task list (live), one task (its transcript
growing live, report, diff with a file tree, cancel/publish/resume), all of it shown as
inert text. See ``docs/how-to/watch-tasks-in-a-browser.md``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from agentbox.config import Settings
from agentbox.errors import TaskError


def serve_ui(settings: Settings, listen: str, *, say: Callable[[str], None]) -> None:
    """Serve the view on ``listen`` (``127.0.0.1:PORT``; 0 picks a port) until interrupted.
    ``say`` gets the login link first, then anything else worth a line."""
    import uvicorn

    from agentbox.core.listen import parse_loopback
    from agentbox.core.wait import socket_accepts
    from agentbox.launcher.client import LauncherClient
    from agentbox.ui._app import make_app, socket_for

    host, port = parse_loopback(listen, flag="--listen", who="the web view")
    path: Path = socket_for(settings.data_dir)
    if not socket_accepts(path):
        raise TaskError(
            f"no launcher answers on {path}: start it (`agentbox launcher serve`, or as a service)"
        )
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    app, session = make_app(
        lambda: LauncherClient(path, timeout=60.0), f"{shown}:{port}", _who(), settings.data_dir
    )
    say(f"http://{shown}:{port}/login?token={session.token}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _who() -> str:
    """This process's user as the page names it (a uid without a passwd entry: its number)."""
    import os
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"
