"""The one subprocess helper: argv lists, group-killing timeouts, errors with context."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from agentbox.core import proc as _proc
from agentbox.errors import CommandError, CommandTimeout


def test_run_captures_output_and_exit_code() -> None:
    res = _proc.run(["sh", "-c", "echo out; echo err >&2; exit 0"])
    assert (res.returncode, res.stdout, res.stderr) == (0, "out\n", "err\n")


def test_failure_carries_argv_code_and_stderr_tail() -> None:
    with pytest.raises(CommandError) as info:
        _proc.run(["sh", "-c", "echo boom >&2; exit 7"])
    err = info.value
    assert err.returncode == 7
    assert err.argv[0] == "sh"
    assert "boom" in str(err) and "exit 7" in str(err)


def test_check_false_returns_nonzero() -> None:
    assert _proc.run(["false"], check=False).returncode == 1


def test_input_is_passed_on_stdin() -> None:
    assert _proc.run(["cat"], input="hello").stdout == "hello"


def test_timeout_kills_the_whole_process_group(tmp_path: object) -> None:
    # The child forks a grandchild that would outlive a naive kill of the leader.
    with pytest.raises(CommandTimeout) as info:
        _proc.run(["sh", "-c", "sleep 300 & echo $! ; wait"], timeout=0.5)
    assert info.value.timeout == 0.5
    time.sleep(0.2)
    sleepers = [
        p for p in psutil.process_iter(["cmdline", "ppid"]) if p.info["cmdline"] == ["sleep", "300"]
    ]
    assert not [p for p in sleepers if p.ppid() in (os.getpid(), 1)], "grandchild survived"


def test_stream_delivers_chunks_and_returns_code() -> None:
    out: list[bytes] = []
    err: list[bytes] = []
    code = _proc.stream(
        ["sh", "-c", "echo a; echo b >&2; exit 3"], on_stdout=out.append, on_stderr=err.append
    )
    assert code == 3
    assert b"".join(out) == b"a\n" and b"".join(err) == b"b\n"


def test_stream_timeout_keeps_what_was_streamed() -> None:
    out: list[bytes] = []
    with pytest.raises(CommandTimeout):
        _proc.stream(
            ["sh", "-c", "echo early; sleep 30"],
            on_stdout=out.append,
            on_stderr=lambda b: None,
            timeout=0.5,
        )
    assert b"early" in b"".join(out)


def test_never_a_shell_string() -> None:
    # A string with shell syntax is one argv element, not a command line.
    with pytest.raises((CommandError, FileNotFoundError)):
        _proc.run(["echo hi; touch /tmp/agentbox-should-not-exist"])
    assert not os.path.exists("/tmp/agentbox-should-not-exist")
