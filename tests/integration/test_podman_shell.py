"""``agentbox shell``: an interactive sandbox on a real terminal (a pty), same hardening."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.podman


def _drain(fd: int, until: float, marker: bytes | None = None) -> bytes:
    """Read the terminal until EOF, ``marker`` or the time runs out."""
    out = b""
    while time.monotonic() < until and not (marker and marker in out):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out


def test_shell_is_interactive_hardened_and_returns_the_exit_code(
    default_image: object, tmp_path: Path
) -> None:
    master, slave = pty.openpty()
    env = {
        "PATH": os.environ["PATH"],
        "TERM": "dumb",
        "AGENTBOX_DATA_DIR": str(tmp_path / "data"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "shell", "--", "/bin/bash", "--norc", "-i"],
        stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    try:
        _drain(master, time.monotonic() + 30, b"$ ")  # the prompt
        os.write(master, b"echo uid=$(id -u) caps=$(grep CapEff /proc/self/status)\n")
        os.write(master, b"touch /usr/x 2>/dev/null || echo ro-root\n")
        os.write(master, b"echo home=$HOME.\n")  # the environment arrived (--env-file)
        os.write(master, b"exit 3\n")
        out = _drain(master, time.monotonic() + 30)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert "uid=64000" in text, text
    assert "caps=CapEff: 0000000000000000" in text, text
    assert "ro-root" in text, text
    assert "home=/home/agent." in text, text
    assert rc == 3
