"""``agentbox gateway … &`` says where it listens once it serves, as ``model serve`` does
(issue 34 item 18): the real command as its own process; fails on the old code (silent)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_gateway_started_by_hand_says_it_listens(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok-0123456789abcdef0123456789abcdef")
    token.chmod(0o600)
    port = _free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "AGENTBOX_CONFIG": str(tmp_path / "none.toml")}  # fmt: skip
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    # --exit-at bounds a gateway that never says it (the old code): the read then ends.
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}",
         "--model", "replay-demo", "--token-file", str(token),
         "--exit-at", str(time.time() + 120)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()  # blocks until the line (or the end)
        assert line.startswith(f"gateway listening on tcp:127.0.0.1:{port} (model replay-demo)"), (
            line,
            proc.poll(),
        )
        # It says so once it serves: a connection is accepted now.
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
