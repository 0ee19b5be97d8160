"""The pure parts of detached docker sandboxes (issue 32): the command that holds the
deadline, the seal, and the follower's copy of the output across a cut stream."""

from __future__ import annotations

from pathlib import Path

from agentbox.backends._k8slog import LogReader
from agentbox.backends.base import SandboxSpec
from agentbox.backends.docker import _detach as detach
from agentbox.backends.docker._config import DEADLINE_GRACE
from agentbox.backends.podman import _detach as podman_detach
from agentbox.config import Settings


def _spec(runtime: str, deadline: float = 99.5) -> SandboxSpec:
    return SandboxSpec(name="agentbox-task-t", image="img", runtime=runtime, deadline=deadline)


def test_the_deadline_is_held_by_timeout_under_tini_and_runc_waits_behind_its_gate() -> None:
    life = str(100 + DEADLINE_GRACE)
    runc = detach.detached_argv(_spec("runc"), ["claude", "-p", "x"])
    assert runc == ["timeout", "-s", "KILL", life, "/bin/sh", "-c", detach.GATE, "gate",
                    "claude", "-p", "x"]  # fmt: skip
    # runsc: no user-namespace caps to wait for (gVisor's own kernel), no gate.
    assert detach.detached_argv(_spec("runsc"), ["claude"]) == ["timeout", "-s", "KILL", life,
                                                                  "claude"]  # fmt: skip


def test_the_seal_is_podmans_and_names_the_data_dir(tmp_path: Path) -> None:
    one = Settings(data_dir=tmp_path / "a")
    other = Settings(data_dir=tmp_path / "b")
    assert detach.seal(one, "n") == podman_detach.seal(one, "n")
    assert detach.seal(one, "n") != detach.seal(one, "m")
    assert detach.seal(one, "n") != detach.seal(other, "n")


def test_a_stream_read_again_from_its_start_delivers_nothing_twice(tmp_path: Path) -> None:
    got: list[tuple[str, bytes]] = []
    log = tmp_path / "sandbox.log"
    with detach._LogCopy(log, lambda b: got.append(("out", b)),
                         lambda b: got.append(("err", b))) as copy:  # fmt: skip
        copy.feed(1, b"line 1\n", 0)
        copy.feed(2, b"warn\n", 0)
        copy.feed(1, b"line 2 part", 7)
        # The daemon restarted: the stream is read again from its start.
        copy.feed(1, b"line 1\n", 0)
        copy.feed(2, b"warn\n", 0)
        copy.feed(1, b"line 2 partial end\n", 7)  # overlaps what was delivered
        copy.feed(1, b"line 3\n", 26)
    assert got == [("out", b"line 1\n"), ("err", b"warn\n"), ("out", b"line 2 part"),
                   ("out", b"ial end\n"), ("out", b"line 3\n")]  # fmt: skip
    # The task's log replays the same output (a follower after the container is gone).
    again: list[bytes] = []
    with LogReader(log, again.append, None) as reader:
        reader.pump()
    assert b"".join(again) == b"line 1\nline 2 partial end\nline 3\n"


def test_engine_times_read_with_their_nanoseconds() -> None:
    assert detach._when("2026-12-07T04:45:11.500000000Z") == 1796618711.5
    assert detach._when("0001-01-01T00:00:00Z") is None
    assert detach._when("") is None
