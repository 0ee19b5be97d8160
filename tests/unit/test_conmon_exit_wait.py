"""``wait_exited``: a conmon has ended when it exits, not when its parent reaps it.

conmon's parent is the host's init, and an init may reap orphans seconds late (this
host's PID 1 took 1.6-2.0 s). The stand-in here is a zombie whose parent never
reaps it while the test runs: waiting for the pid to disappear (``psutil``'s
``wait``, the old way) would block for the whole timeout; ``wait_exited`` returns
as soon as the process has exited, and the zombie is still there when it does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agentbox.backends.podman._exitfile import wait_exited

# A parent that starts a child which exits at once, prints the child's pid, and never
# reaps it (until the parent itself ends).
_PARENT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()
"""


def _zombie_of_another_parent() -> tuple[subprocess.Popen[str], psutil.Process]:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    return parent, psutil.Process(int(parent.stdout.readline()))


def test_an_exited_process_not_yet_reaped_has_exited() -> None:
    parent, child = _zombie_of_another_parent()
    try:
        assert wait_exited(child, timeout=60)
        assert Path(f"/proc/{child.pid}").exists(), "reaped meanwhile: the test proves nothing"
        assert child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.communicate("")  # the parent ends; init reaps the child


def test_a_running_process_is_waited_for_until_the_timeout() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert wait_exited(psutil.Process(proc.pid), timeout=0.2) is False
    finally:
        proc.kill()
        proc.wait()


def test_a_reaped_process_has_exited() -> None:
    proc = subprocess.Popen(["true"])
    ps = psutil.Process(proc.pid)
    proc.wait()
    assert wait_exited(ps, timeout=60)


@pytest.mark.parametrize("timeout", [0.0, 0.05])
def test_the_timeout_is_a_bound_not_a_sleep(timeout: float) -> None:
    parent, child = _zombie_of_another_parent()
    try:
        assert wait_exited(child, timeout=60)  # it has exited: a zombie now
        assert wait_exited(child, timeout=timeout)  # and a zero wait sees that at once
    finally:
        parent.communicate("")
