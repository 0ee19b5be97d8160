"""A detached task's gateway is stopped as soon as its follower records the sandbox's end
(``<log>.exit``), beside the disk's copy back and the sandbox's removal instead of after
them (``launcher/_runner.py``: ``_stop_at_end``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agentbox.backends._k8slog import exit_marker, write_exit
from agentbox.backends.base import Exited
from agentbox.launcher._runner import _stop_at_end


class _Gateway:
    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.graces: list[float] = []

    def stop(self, grace: float = 5.0) -> int | None:
        self.graces.append(grace)
        self.stopped.set()
        return 0


def test_the_gateway_stops_when_the_end_is_recorded_and_not_before(tmp_path: Path) -> None:
    log = tmp_path / "sandbox.log"
    log.write_bytes(b"")
    gw = _Gateway()
    over = _stop_at_end(gw, exit_marker(log), "t-stop")  # type: ignore[arg-type]
    try:
        (tmp_path / "agent.jsonl").write_text("output\n")  # other files of the dir: no stop
        assert not gw.stopped.wait(1.0), "stopped before the end was recorded"
        write_exit(log, Exited(0, False))
        assert gw.stopped.wait(30), "the gateway was not stopped at the recorded end"
        assert gw.graces == [3.0]
    finally:
        over.set()


def test_a_follow_that_ends_without_a_record_leaves_the_stop_to_the_caller(
    tmp_path: Path,
) -> None:
    log = tmp_path / "sandbox.log"
    gw = _Gateway()
    over = _stop_at_end(gw, exit_marker(log), "t-over")  # type: ignore[arg-type]
    over.set()
    time.sleep(1.0)  # its thread looks again within 0.5 s and gives up
    write_exit(log, Exited(1, False))
    assert not gw.stopped.wait(1.5)
