"""What a command run in a sandbox returns, and the callback its output streams to.

Defined below both the backends (:mod:`agentbox.backends.base` re-exports them, part
of the Protocol) and the microVM machinery (:mod:`agentbox.backends.microvm`, whose guest
channel builds them), so that the machinery never imports the backends it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ExecResult", "OutputCallback"]

#: Called with each piece of a command's stdout or stderr as it arrives.
OutputCallback = Callable[[bytes], None]


@dataclass(frozen=True)
class ExecResult:
    """A finished command in a sandbox. Output is empty when it was streamed to callbacks."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
