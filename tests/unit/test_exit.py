"""``agentbox.core.exit``: the CLI and the gateway end with ``os._exit`` once done, but only
after what a normal exit does that matters: threads joined, exit handlers run, the
buffered output flushed, and the status a ``SystemExit`` carries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentbox.core.exit import exit_code

_PROGRAM = """
import atexit, sys, threading, time
from agentbox.core.exit import end_process

atexit.register(lambda: sys.stdout.write("exit handler\\n"))
def late():
    time.sleep(0.3)
    sys.stdout.write("thread\\n")
threading.Thread(target=late).start()
sys.stdout.write("buffered, not flushed\\n")
end_process(7)
"""


def test_end_process_joins_threads_runs_exit_handlers_and_flushes() -> None:
    res = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True)
    assert res.returncode == 7, res.stderr
    assert res.stdout == "buffered, not flushed\nthread\nexit handler\n"


@pytest.mark.parametrize(
    ("code", "status", "said"),
    [(None, 0, ""), (0, 0, ""), (3, 3, ""), (260, 4, ""), ("no task", 1, "no task\n")],
)
def test_exit_code_is_what_sys_exit_would_give(
    code: object, status: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(SystemExit(code)) == status
    assert capsys.readouterr().err == said


def test_the_command_exits_with_its_status() -> None:
    ok = subprocess.run([sys.executable, "-m", "agentbox", "--version"], capture_output=True)
    assert ok.returncode == 0 and ok.stdout.startswith(b"agentbox ")
    bad = subprocess.run([sys.executable, "-m", "agentbox", "no-such-command"], capture_output=True)
    assert bad.returncode == 2 and b"No such command" in bad.stderr


_ANNOUNCING = """
import os, sys, time
from agentbox.core.exit import announce_exit_to, end_process

fd = int(sys.argv[1])
announce_exit_to(fd)
if os.fork() == 0:  # a fork of an announcing process ends without a word
    end_process(9)
os.wait()
sys.stdout.write("its output\\n")
end_process(7)
"""


def test_an_announcing_process_tells_its_status_once_its_output_is_let_go() -> None:
    """A served command (agentbox.front) says its status on the waiter's pipe after its
    output is flushed and its standard streams let go of, before ``os._exit``; a fork of
    it says nothing."""
    import os

    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ANNOUNCING, str(w)],
            stdout=subprocess.PIPE,
            pass_fds=(w,),
        )
        os.close(w)
        w = -1
        assert proc.stdout is not None
        out = proc.stdout.read()  # EOF: the process let go of its stdout
        told = os.read(r, 16)
        assert out == b"its output\n"
        assert told == bytes([7]), "the status was not told, or the fork told one too"
        assert proc.wait(30) == 7
        proc.stdout.close()
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
