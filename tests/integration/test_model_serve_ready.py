"""``agentbox model serve`` says where it listens once it does (issue 13 section 5).

Before, it printed nothing when ready: a user who started it in the background (as
the delegate tutorial does) could not tell when, or on which port, to point a
client at it. The real CLI in a child process, a real TCP socket, a real request.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SCRIPT = """\
name: ready
main: all
turns:
  - text: "pong"
"""


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first stderr line, or '' if none came while the process lived (a hang guard)."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    end = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf and time.monotonic() < end and proc.poll() is None:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.decode(errors="replace").split("\n", 1)[0]


def test_model_serve_prints_the_address_it_listens_on(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SCRIPT)
    # Port 0: only the ready line can tell the client which port it got.
    argv = [sys.executable, "-m", "agentbox", "model", "serve"]
    argv += ["--script", str(tmp_path / "s.yaml"), "--listen", "tcp:127.0.0.1:0"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        line = _read_line(proc, 60.0)
        m = re.search(r"listening on tcp:127\.0\.0\.1:(\d+)", line)
        assert m, f"no ready line with the address; got {line!r}"
        port = int(m.group(1))
        assert port != 0
        body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "ping"}]}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/messages",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            answer = json.loads(resp.read())
        assert answer["content"][0]["text"] == "pong"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_model_serve_on_a_unix_socket_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SCRIPT)
    sock = tmp_path / "m.sock"
    argv = [sys.executable, "-m", "agentbox", "model", "serve"]
    argv += ["--script", str(tmp_path / "s.yaml"), "--listen", f"unix:{sock}"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        line = _read_line(proc, 60.0)
        assert f"listening on unix:{sock}" in line, line
        assert sock.is_socket()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
