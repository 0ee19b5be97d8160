"""Reading a models file and the replay scripts it names: regular files, bounded, UTF-8."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentbox.errors import ConfigError

#: A models file larger than this is refused (a registry is a few KB; this is a config
#: file, not a place for data, and a huge one should not stall whoever reads it).
MAX_REGISTRY_BYTES = 1 << 20


def check_script(path: Path, where: str) -> None:
    """A replay entry's script must be a readable regular file now, not only inside a task."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(
            f"{where}: replay script {path} cannot be read ({exc.strerror})"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: replay script {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{where}: replay script {path} is not readable")


def read_registry_file(path: Path) -> str:
    """The text of a models file: a regular file, at most :data:`MAX_REGISTRY_BYTES`, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"cannot read model registry {path}: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"cannot read model registry {path}: not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_REGISTRY_BYTES:
            chunk = os.read(fd, MAX_REGISTRY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"cannot read model registry {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_REGISTRY_BYTES:
        raise ConfigError(
            f"cannot read model registry {path}: larger than {MAX_REGISTRY_BYTES} bytes"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cannot read model registry {path}: not UTF-8 (byte {exc.start}: {exc.reason})"
        ) from None
