"""A detached task's gateway is stopped as soon as its follower records the sandbox's end
(``<log>.exit``), beside the disk's copy back and the sandbox's removal instead of after
them (``launcher/_runner.py``: ``_StopAtEnd``); the caller's own stop afterwards never
signals it a second time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agentbox.backends._k8slog import exit_marker, write_exit
from agentbox.backends.base import Exited
from agentbox.launcher._runner import _StopAtEnd


class _Gateway:
    """Records its stops; a stop takes ``slow`` seconds (a gateway's graceful shutdown)."""

    def __init__(self, slow: float = 0.0) -> None:
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.stops = 0
        self.slow = slow

    def stop(self, grace: float = 5.0) -> int | None:
        assert grace == 3.0
        self.stops += 1
        self.stopping.set()
        time.sleep(self.slow)
        self.stopped.set()
        return 0


def test_the_gateway_stops_when_the_end_is_recorded_and_not_before(tmp_path: Path) -> None:
    log = tmp_path / "sandbox.log"
    log.write_bytes(b"")
    gw = _Gateway()
    early = _StopAtEnd(gw, exit_marker(log), "t-stop")  # type: ignore[arg-type]
    try:
        (tmp_path / "agent.jsonl").write_text("output\n")  # other files of the dir: no stop
        assert not gw.stopped.wait(1.0), "stopped before the end was recorded"
        write_exit(log, Exited(0, False))
        assert gw.stopped.wait(30), "the gateway was not stopped at the recorded end"
    finally:
        early.done()
    assert gw.stops == 1


def test_done_waits_for_a_stop_under_way(tmp_path: Path) -> None:
    """The follow ends while the early stop still waits for the gateway: ``done`` returns
    only once that stop is over, so the caller's own stop finds nothing to signal."""
    log = tmp_path / "sandbox.log"
    gw = _Gateway(slow=1.0)
    early = _StopAtEnd(gw, exit_marker(log), "t-slow")  # type: ignore[arg-type]
    write_exit(log, Exited(0, False))
    assert gw.stopping.wait(30)
    early.done()
    assert gw.stopped.is_set(), "done returned while the early stop was under way"
    assert gw.stops == 1


def test_a_follow_that_ends_without_a_record_leaves_the_stop_to_the_caller(
    tmp_path: Path,
) -> None:
    log = tmp_path / "sandbox.log"
    gw = _Gateway()
    early = _StopAtEnd(gw, exit_marker(log), "t-over")  # type: ignore[arg-type]
    early.done()
    write_exit(log, Exited(1, False))
    assert not gw.stopped.wait(1.5)
    assert gw.stops == 0
