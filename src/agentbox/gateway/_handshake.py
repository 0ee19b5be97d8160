"""The gateway's handshake file: what a launcher checks before it re-adopts a gateway.

A task's gateway outlives the launcher that started it (live restore); the next
launcher, maybe of a newer version, verifies the process it finds (pid, start time,
command line) and then reads ``gateway.json``, which the gateway writes beside its
usage file when it starts, before it drops privileges or reads a byte from the
sandbox: ``{"v": HANDSHAKE_VERSION, "pid": ..., "started": ...}``. A launcher adopts a
gateway whose version it knows and refuses (the task is settled, with the reason) one
of a newer version, or one that wrote no handshake, whose control and files it cannot
vouch for.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

#: Bumped when what a launcher relies on in a running gateway changes (its files,
#: its signals, its command line); a launcher adopts versions up to its own.
HANDSHAKE_VERSION = 1
HANDSHAKE_FILE = "gateway.json"
_MAX_BYTES = 4096


@dataclass(frozen=True)
class Handshake:
    version: int
    pid: int
    started: float


def write_handshake(state_dir: Path) -> None:
    """Write this process's handshake into ``state_dir``, replacing an older one at once
    (a reader never sees it half written)."""
    data = {"v": HANDSHAKE_VERSION, "pid": os.getpid(), "started": round(time.time(), 3)}
    tmp = state_dir / f".{HANDSHAKE_FILE}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(data))
    tmp.replace(state_dir / HANDSHAKE_FILE)


def read_handshake(state_dir: Path) -> Handshake | None:
    """The handshake in ``state_dir``: None when there is none; ``ValueError`` naming
    what is wrong when it is malformed."""
    path = state_dir / HANDSHAKE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: cannot open: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(_MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    v, pid, started = data.get("v"), data.get("pid"), data.get("started")
    if type(v) is not int or v < 1:
        raise ValueError(f"{path}: 'v' must be a positive integer, not {v!r}")
    if type(pid) is not int or pid < 1:
        raise ValueError(f"{path}: 'pid' must be a positive integer, not {pid!r}")
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        raise ValueError(f"{path}: 'started' must be a number, not {started!r}")
    return Handshake(v, pid, float(started))
