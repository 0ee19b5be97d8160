"""The unix-socket transport of the launcher client: a refused connect leaks nothing.

httpcore 1.0.9's sync ``connect_unix_socket`` leaves its socket to the garbage
collector when ``connect()`` fails, so a client riding through a launcher restart
leaked one socket per refused attempt (a ``ResourceWarning`` each).
"""

from __future__ import annotations

import gc
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agentbox import errors
from agentbox.core.uds import unix_transport
from agentbox.launcher.client import LauncherClient

ATTEMPTS = 20


def _refusing(path: Path) -> None:
    """A socket file nobody listens on (bound, then closed): connect gets ECONNREFUSED."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    finally:
        s.close()


def _leaks(call: Callable[[], None], attempts: int = ATTEMPTS) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(attempts):
            call()
        gc.collect()
    return [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("kind", ["refused", "missing"])
def test_refused_connects_leak_no_socket(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "launcher.sock"
    if kind == "refused":
        _refusing(path)
    client = LauncherClient(path, reconnect=0.0)

    def call() -> None:
        with pytest.raises(errors.TaskError, match="cannot reach the launcher") as info:
            client.list()
        assert isinstance(info.value.__cause__, httpx.ConnectError)

    try:
        assert _leaks(call) == []
    finally:
        client.close()


def test_retries_through_refusals_leak_nothing(tmp_path: Path) -> None:
    """The reconnect loop itself (several refused attempts inside one call)."""
    path = tmp_path / "launcher.sock"
    _refusing(path)
    with LauncherClient(path, reconnect=0.2) as client:

        def call() -> None:
            with pytest.raises(errors.TaskError):
                client.models()

        assert _leaks(call, attempts=2) == []


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """A one-answer-per-connection HTTP server on a unix socket; the answers are queued."""
    path = tmp_path / "s.sock"
    answers: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            conn, _ = srv.accept()
            with conn:
                if stop.is_set():
                    return
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
                conn.sendall(answers.pop(0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield path, answers
    finally:
        stop.set()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))  # wake accept()
        t.join(10)
        srv.close()


def test_answers_and_drops_are_mapped(server: tuple[Path, list[bytes]]) -> None:
    """A real answer is read; a connection dropped mid-answer is a RemoteProtocolError,
    which the client retries for a GET (the restart path)."""
    path, answers = server
    body = b'{"models": []}'
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    answers += [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", ok % (len(body), body)]
    with LauncherClient(path, reconnect=5.0) as client:
        assert client.models() == []  # the first answer was cut short, the retry read
    assert answers == []
    answers.append(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
    with (
        httpx.Client(transport=unix_transport(path), base_url="http://x") as http,
        pytest.raises(httpx.RemoteProtocolError),
    ):
        http.get("/v1/models")
