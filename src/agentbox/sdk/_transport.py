"""Where the SDK's launcher is, and the one transport to it (:class:`LauncherClient`)."""

from __future__ import annotations

import os
from pathlib import Path

from agentbox.launcher.client import LauncherClient

#: An environment variable naming the launcher's socket (else the data dir's).
ADDRESS_ENV = "AGENTBOX_LAUNCHER_SOCKET"


def default_address() -> Path:
    """``$AGENTBOX_LAUNCHER_SOCKET``, else ``<data_dir>/launcher.sock`` of the settings."""
    given = os.environ.get(ADDRESS_ENV)
    if given:
        return Path(given)
    from agentbox.config import load_settings

    return load_settings().data_dir / "launcher.sock"


def connect(address: str | os.PathLike[str] | None = None) -> LauncherClient:
    """A client of the launcher at ``address`` (a unix socket path; None: the local one)."""
    path = Path(address) if address is not None else default_address()
    return LauncherClient(path, timeout=60.0)
