"""The sandbox's entry command (``_oci_args.entry_argv``): no Python before the agent.

The real entry argv, run on the host with the guest files laid out as in the image
(``relay.py`` and the C relay built next to it by the same function the image build
uses), under ``strace -f -e trace=execve``: with the C relay present no Python
interpreter starts (each cost a task 0.05-0.17 s before its command ran), the command
runs and the relay serves; without it (an image built before the C relay) it falls
back to ``relay.py``. Counts, not times.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci._args import RELAY_PATH, entry_argv
from agentbox.image._relay import RELAY_BINARY, RELAY_SOURCE, compile_relay

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

RELAY = Path(__file__).resolve().parents[2] / "src/agentbox/guest/relay.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_servers(guest: Path, tracer: int) -> None:
    """The relay's detached server (its own session) outlives the command: end it."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == tracer:
            continue
        with contextlib.suppress(OSError):
            cmd = (p / "cmdline").read_bytes()
            if str(guest).encode() in cmd:
                os.kill(int(p.name), signal.SIGKILL)


def _run_entry(tmp_path: Path, guest: Path) -> tuple[str, list[str]]:
    """Run the entry argv of a sandbox with a gateway, the command echoing a word; return
    its output and the programs it exec'd."""
    spec = SandboxSpec(name="entry", image="x", gateway_dir=tmp_path)
    argv = entry_argv(spec, ["sh", "-c", "echo ran"])
    assert RELAY_PATH in argv
    argv = [str(guest / "relay.py") if a == RELAY_PATH else a for a in argv]
    argv[argv.index("--port") + 1] = str(_free_port())
    trace = tmp_path / "trace"
    proc = subprocess.Popen(
        ["strace", "-f", "-q", "-e", "trace=execve", "-o", str(trace), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # strace ends with the last traced process: the relay's server never does. Once
        # the entry process itself (the first traced, the command in the end) has
        # exited, the server goes too.
        deadline = time.monotonic() + 60
        while not _root_line(trace):
            assert proc.poll() is None and time.monotonic() < deadline, "the entry never ended"
            time.sleep(0.02)
    finally:
        _kill_servers(guest, proc.pid)
        out, err = proc.communicate(timeout=60)
    assert _root_line(trace).endswith("+++ exited with 0 +++"), err
    execs = [
        ln.split('execve("', 1)[1].split('"', 1)[0]
        for ln in trace.read_text().splitlines()
        if 'execve("' in ln and "= 0" in ln
    ]
    return out, execs


def _root_line(trace: Path) -> str:
    """The line saying how the first traced process ended ("" while it runs); strace
    pads pids to a width, so fields are split, not prefixes compared."""
    lines = trace.read_text().splitlines() if trace.exists() else []
    root = lines[0].split()[0] if lines else ""
    return next((ln for ln in lines if ln.split()[:2] == [root, "+++"]), "")


def test_with_the_c_relay_no_python_starts(tmp_path: Path) -> None:
    guest = tmp_path / "guest"
    guest.mkdir()
    shutil.copyfile(RELAY, guest / "relay.py")
    compile_relay(RELAY.with_name(RELAY_SOURCE), guest / RELAY_BINARY)
    out, execs = _run_entry(tmp_path, guest)
    assert out == "ran\n"
    assert not [e for e in execs if "python" in Path(e).name], execs
    assert str(guest / RELAY_BINARY) in execs


def test_without_it_the_python_relay_still_serves(tmp_path: Path) -> None:
    guest = tmp_path / "guest"
    guest.mkdir()
    shutil.copyfile(RELAY, guest / "relay.py")
    out, execs = _run_entry(tmp_path, guest)
    assert out == "ran\n"
    assert [e for e in execs if "python" in Path(e).name], execs
