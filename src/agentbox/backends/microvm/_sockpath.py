"""A unix socket path the kernel takes, however deep the data dir is.

``sun_path`` holds 107 bytes. A VM's sockets live in its VM dir under the data
dir (``<data_dir>/microvm/<sandbox>-<hex>/run/agent.sock``), and a task's
gateway and egress sockets in its task dir: with a deep data dir and a long
task id the path is longer than that, and ``connect`` fails (seen: a setup
sandbox's 109-byte agent socket path, "QEMU's agent socket never appeared").
QEMU itself binds the jail's short ``/vm/run/…`` names; the host side connects
through a descriptor of the socket's directory instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: Longest path ``connect`` takes on Linux (``sun_path`` is 108 bytes with its NUL).
MAX_SUN_PATH = 107


@contextlib.contextmanager
def connectable(path: Path) -> Iterator[str]:
    """``path`` itself when it fits, else ``/proc/self/fd/<fd>/<name>`` through an
    ``O_PATH`` descriptor of its directory, open for the ``with`` block."""
    if len(os.fsencode(path)) <= MAX_SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
