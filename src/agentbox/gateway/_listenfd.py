"""The gateway's listening socket, bound by the launcher and inherited by the gateway.

:func:`~agentbox.gateway.spawn_gateway` binds a task's unix socket itself and passes
the listening descriptor to the gateway process, naming it in :data:`LISTEN_FD_ENV`
(as systemd's socket activation does): the socket exists, with its final mode and
owner, the moment the gateway is started, and a client that connects before the
gateway serves waits in the backlog instead of being refused. The gateway still
names its socket on its command line (``--listen unix:PATH``: how a launcher finds
a task's gateway) and takes the inherited descriptor only when it is a listening
unix stream socket bound at exactly that path.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from agentbox.errors import ConfigError

#: The environment variable naming the inherited listening descriptor.
LISTEN_FD_ENV = "AGENTBOX_GATEWAY_LISTEN_FD"


def inherited_listener(path: Path) -> socket.socket | None:
    """The listening socket at ``path`` this process inherited, if :data:`LISTEN_FD_ENV`
    names one; None when it names none. The variable is removed either way (nothing
    this process starts inherits it). :class:`ConfigError` when the descriptor is not a
    listening unix stream socket bound at ``path``."""
    raw = os.environ.pop(LISTEN_FD_ENV, None)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 3:
        raise ConfigError(f"{LISTEN_FD_ENV}={raw!r} is not an inherited descriptor")
    fd = int(raw)
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"{LISTEN_FD_ENV}={fd}: not a socket ({exc})") from exc
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ConfigError(f"{LISTEN_FD_ENV}={fd} is not a unix stream socket")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ConfigError(f"{LISTEN_FD_ENV}={fd} is not listening")
        if sock.getsockname() != str(path):
            raise ConfigError(
                f"{LISTEN_FD_ENV}={fd} is bound at {sock.getsockname()!r}, not {str(path)!r}"
            )
    except (ConfigError, OSError) as exc:
        sock.detach()  # not ours to close: the descriptor stays as it was
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{LISTEN_FD_ENV}={fd}: {exc}") from exc
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock
