"""agentbox.core.wait: the one polling helper, on real clocks and a real unix socket."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from agentbox.core.wait import socket_accepts, wait_until


class Late(Exception):
    pass


def test_returns_the_first_value_the_check_gives() -> None:
    calls = iter([None, False, 0, "x"])
    # 0 is a value (not None/False): returned as soon as it comes.
    assert wait_until(lambda: next(calls), timeout=5, on_timeout=Late, interval=0.001) == 0


def test_raises_the_callers_error_past_the_timeout() -> None:
    seen = []
    with pytest.raises(Late):
        wait_until(lambda: seen.append(1), timeout=0.05, on_timeout=Late, interval=0.01)
    assert len(seen) >= 2  # polled, and once more at the deadline


def test_an_error_from_the_check_stops_the_wait() -> None:
    def check() -> None:
        raise RuntimeError("child exited")

    with pytest.raises(RuntimeError, match="child exited"):
        wait_until(check, timeout=5, on_timeout=Late)


def test_waits_for_a_socket_that_starts_listening_later(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    assert not socket_accepts(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(path))
        assert not socket_accepts(path)  # bound, not listening: refused
        timer = threading.Timer(0.1, srv.listen)
        timer.start()
        assert wait_until(lambda: socket_accepts(path), timeout=30, on_timeout=Late) is True
        timer.join()
    finally:
        srv.close()


def test_gateway_wait_for_socket_says_what_went_wrong(tmp_path: Path) -> None:
    import subprocess
    import sys

    from agentbox.errors import GatewayError
    from agentbox.gateway._process import wait_for_socket

    path = tmp_path / "gw.sock"
    with pytest.raises(GatewayError, match=r"did not listen on .* within 0\.1s"):
        wait_for_socket(path, timeout=0.1, proc=None)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    proc.wait()
    with pytest.raises(GatewayError, match="exited with code 7 before listening"):
        wait_for_socket(path, timeout=30, proc=proc)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(path))
        srv.listen()
        wait_for_socket(path, timeout=30, proc=None)
    finally:
        srv.close()
