"""Relative names beneath a root: checked, shown safely, and git's mode bits."""

from __future__ import annotations

import os
import stat

from agentbox.errors import PathRefused

MAX_NAME = 255
MAX_PATH = 4096
_CONTROL = frozenset([*range(0x20), 0x7F])


def check_name(rel: bytes | str) -> list[bytes]:
    """Split a relative path into components, or raise PathRefused.

    Refused: absolute paths, empty, ``.`` or ``..`` components, NUL or control
    characters (a newline in a name breaks every line-based tool a reviewer
    uses), a component over 255 bytes, a path over 4096.
    """
    raw = os.fsencode(rel)
    if not raw or len(raw) > MAX_PATH:
        raise PathRefused("empty or over-long path", path=show(raw))
    if raw.startswith(b"/"):
        raise PathRefused("absolute path", path=show(raw))
    if any(b in _CONTROL for b in raw):
        raise PathRefused("control character in name", path=show(raw))
    parts = raw.split(b"/")
    for part in parts:
        if part in (b"", b".", b".."):
            raise PathRefused("empty, '.' or '..' component", path=show(raw))
        if len(part) > MAX_NAME:
            raise PathRefused("component over 255 bytes", path=show(raw))
    return parts


def show(rel: bytes | str) -> str:
    """A path made safe to print: utf-8 with backslash escapes, control characters escaped."""
    text = os.fsencode(rel).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def git_mode(st_mode: int) -> int:
    """The permission bits git would record: 0o755 if owner-executable, else 0o644."""
    return 0o755 if st_mode & stat.S_IXUSR else 0o644
