"""The launcher's waits go through :func:`agentbox.core.wait.wait_until` (issue 14 item 7):
the client's ``wait`` and ``launcher stop``'s wait for the serving process to let go.

The client talks HTTP to a real handler (httpx's ``MockTransport``: the whole client,
its parsing and errors, runs); ``stop_launcher`` signals a real process holding the
real lock file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agentbox.errors import TaskError
from agentbox.launcher import LauncherClient
from agentbox.launcher._server import LOCK_NAME, RUN_DIR, STOP_SIGNALS
from agentbox.launcher._stop import serving_pid, stop_launcher


def _client(statuses: list[str]) -> tuple[LauncherClient, list[str]]:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        status = statuses[min(len(asked), len(statuses) - 1)]
        asked.append(status)
        body = {"id": "t-wait", "status": status, "repo": "/r", "task": "t", "model": "m",
                "budget": 1, "deadline": 60.0, "created_at": 1.0}  # fmt: skip
        return httpx.Response(200, content=json.dumps(body).encode())

    client = LauncherClient("/nonexistent.sock")
    client._http.close()
    client._http = httpx.Client(transport=httpx.MockTransport(answer), base_url="http://l")
    return client, asked


def test_client_wait_polls_until_terminal() -> None:
    client, asked = _client(["queued", "running", "running", "done"])
    with client:
        info = client.wait("t-wait", timeout=30, poll=0.001)
    assert info.status == "done" and asked == ["queued", "running", "running", "done"]


def test_client_wait_says_the_last_status_past_its_timeout() -> None:
    client, asked = _client(["running"])
    with client, pytest.raises(TaskError, match=r"still running after 0\.05s"):
        client.wait("t-wait", timeout=0.05, poll=0.01)
    assert len(asked) >= 2  # looked more than once, and once more at the end


#: A stand-in ``launcher serve``: takes the lock as the real one does (its pid in it,
#: flock-ed for its life); on the stop signal it leaves after a short while ("stop")
#: or carries on ("ignore").
_SERVER = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0); os.pwrite(fd, str(os.getpid()).encode(), 0)
stop = sys.argv[3] == "stop"
signal.signal(int(sys.argv[2]), lambda *_: (time.sleep(0.3), sys.exit(0)) if stop else None)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _server(lock: Path, how: str) -> subprocess.Popen[bytes]:
    lock.parent.mkdir(exist_ok=True)
    sig = str(int(STOP_SIGNALS["leave"]))
    argv = [sys.executable, "-c", _SERVER, str(lock), sig, how, "launcher", "serve"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_stop_launcher_waits_for_the_server_to_let_go(tmp_path: Path) -> None:
    lock = tmp_path / RUN_DIR / LOCK_NAME
    proc = _server(lock, "stop")
    try:
        assert serving_pid(lock) == proc.pid
        assert stop_launcher(tmp_path, "leave", timeout=30) == proc.pid
        assert serving_pid(lock) is None  # returned only once the lock was let go
    finally:
        _end(proc)


def test_stop_launcher_times_out_on_a_server_that_does_not_stop(tmp_path: Path) -> None:
    lock = tmp_path / RUN_DIR / LOCK_NAME
    proc = _server(lock, "ignore")
    try:
        with pytest.raises(TaskError, match=r"still stopping after 0\.3s"):
            stop_launcher(tmp_path, "leave", timeout=0.3)
        assert serving_pid(lock) == proc.pid  # it still serves: the wait gave up, said so
    finally:
        _end(proc)
