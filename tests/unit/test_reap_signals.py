"""``agentbox.cli.reap.exit_on_signals``: a signal that ends the process runs the cleanup first.

Each test runs a real Python child that holds a "sandbox" (a marker file it must
remove) inside the helper, sends it a real signal and checks what a parent sees.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import signal, sys, time
from pathlib import Path
from agentbox.cli.reap import exit_on_signals
held = Path(sys.argv[1])
# Start from the dispositions a process started by an interactive shell has, whatever
# this test's own parent ignores (a CI runner started in the background ignores INT).
for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"):
    signal.signal(getattr(signal, name), signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
if sys.argv[2] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
with exit_on_signals():
    held.write_text("sandbox")
    try:
        if sys.argv[2] == "catch":
            try:
                print("ready", flush=True)
                time.sleep(60)
            except KeyboardInterrupt:
                print("caught", flush=True)
        else:
            print("ready", flush=True)
            time.sleep(60)
    finally:
        print("cleaning", flush=True)
        time.sleep(float(sys.argv[3]))
        held.unlink()
print("after", flush=True)
sys.exit(7)
"""


def _child(tmp_path: Path, mode: str = "plain", cleanup: float = 0.0) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "held"), mode, str(cleanup)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
        cwd=tmp_path,  # a core dump (SIGQUIT) lands there, if the host keeps them
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1]
)
def test_a_signal_cleans_up_then_ends_the_process_by_it(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _child(tmp_path)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert not (tmp_path / "held").exists(), "the cleanup did not run"
    assert "after" not in out
    assert proc.returncode == -sig  # what a shell reports as 128 + sig


def test_signals_during_the_cleanup_do_not_cut_it_short(tmp_path: Path) -> None:
    proc = _child(tmp_path, cleanup=1.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "cleaning\n"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert not (tmp_path / "held").exists()
    assert proc.returncode == -signal.SIGTERM


def test_an_ignored_signal_stays_ignored(tmp_path: Path) -> None:
    """``nohup`` means it: SIGHUP does not end the process."""
    proc = _child(tmp_path, mode="nohup")
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None
    assert (tmp_path / "held").exists()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_a_block_that_handles_it_chooses_its_exit(tmp_path: Path) -> None:
    """``agentbox run`` catches it like Ctrl-C (cancel, collect) and exits as it decides."""
    proc = _child(tmp_path, mode="catch")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert out.splitlines()[:3] == ["caught", "cleaning", "after"]
    assert proc.returncode == 7
