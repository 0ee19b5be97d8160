"""Polling, said once: :func:`wait_until` a condition holds, and :func:`socket_accepts`.

Where agentbox waits for something it cannot be told about (a unix socket to
start accepting, a child to be ready), it polls: call ``check`` until it returns
a value that is not ``None`` or ``False``, sleeping ``interval`` between calls,
and raise the caller's own error (built by ``on_timeout``) once ``timeout``
seconds have passed. ``check`` may raise to stop the wait early (a child that
exited, say); that exception propagates unchanged.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["socket_accepts", "wait_until"]

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None],
    *,
    timeout: float,
    on_timeout: Callable[[], BaseException],
    interval: float = 0.02,
) -> T:
    """``check()``'s first result other than ``None``/``False``; past ``timeout``, ``on_timeout()``.

    ``check`` runs at least once, and once more after the last sleep, so a
    condition that holds at the deadline is still seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise on_timeout()
        time.sleep(min(interval, left))


def socket_accepts(path: Path | str, *, connect_timeout: float = 1.0) -> bool:
    """True if a unix stream socket at ``path`` accepts a connection now (closed at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(connect_timeout)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True
