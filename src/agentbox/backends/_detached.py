"""What every backend's detached verbs share: the data dir's seal key and the checks
of a ``launch`` request (podman's ``podman/_detach.py``, qemu's ``qemu/_detach.py``)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from agentbox.config import Settings
from agentbox.errors import ConfigError


def detach_key(settings: Settings) -> bytes:
    """``<data_dir>/detach.key`` (32 random bytes, 0600), made on first use.

    Published whole by a hard link of a private temporary file, so a process racing
    its maker reads either no key (and links its own, losing to the first) or the
    whole one, never an empty or half-written file.
    """
    path = settings.data_dir / "detach.key"
    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".detach.key.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink()
    return path.read_bytes()


def check_launch(argv: Sequence[str], log: Path) -> None:
    """Refuse a ``launch`` with no command, or a log that is not an absolute path in an
    existing directory."""
    if not argv:
        raise ConfigError("launch needs a command")
    if not log.is_absolute() or not log.parent.is_dir():
        raise ConfigError(f"the sandbox log must be an absolute path in a directory: {log}")
