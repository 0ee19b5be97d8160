"""The guest agent's socket transport, driven end to end from the host side.

The real ``agent.py`` runs in its own process, the way the guest runs it (the
system ``python3 -I -S``, stdlib only) but as ``nobody`` so it cannot touch
this host's clock or limits, and serves one session on an AF_UNIX listener
(the guest listens on AF_VSOCK; the session code is the same). Between it and
the host sits a stand-in for Firecracker's vsock muxer that speaks the hybrid
handshake and then relays bytes. The host uses the real ``connect_vsock``,
``Channel`` and ``GuestSession``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._guest import GuestSession, KernelFacts, host_kernel
from agentbox.backends.microvm._vsock import connect_vsock
from agentbox.errors import GuestError
from agentbox.guest import agent as agent_module
from agentbox.guest.agent import transport_from_cmdline

NOBODY = 65534
#: Debian's python3, as in the guest image (not a per-user shim nobody cannot run).
PYTHON = "/usr/bin/python3"

_DRIVER = """
import importlib.util, socket, sys
spec = importlib.util.spec_from_file_location("agent", sys.argv[1])
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[2])
srv.listen(1)
print("listening", flush=True)
agent.serve_one(srv)
print("session over", flush=True)
"""


@pytest.mark.parametrize(
    ("cmdline", "want"),
    [
        ("console=ttyS0 quiet agentbox_transport=vsock init=/init", "vsock"),
        ("agentbox_transport=vsock", "vsock"),
        ("console=ttyS0 quiet init=/init", "virtio-serial"),
        ("agentbox.transport=vsock", "virtio-serial"),
        ("agentbox_transport=vsockx", "virtio-serial"),
        ("xagentbox_transport=vsock", "virtio-serial"),
        ("", "virtio-serial"),
    ],
)
def test_transport_from_cmdline(cmdline: str, want: str) -> None:
    assert transport_from_cmdline(cmdline) == want


class Muxer:
    """Firecracker's side of hybrid vsock: ``CONNECT p`` → connect to the guest → ``OK``."""

    def __init__(self, path: Path, guest: Path) -> None:
        self.path = path
        self.guest = guest
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(8)
        self.refused = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                host, _ = self.srv.accept()
            except OSError:
                return
            line = b""
            while not line.endswith(b"\n") and len(line) < 64:
                b = host.recv(1)
                if not b:
                    break
                line += b
            guest = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                assert line == b"CONNECT 1024\n", line
                guest.connect(str(self.guest))
            except (OSError, AssertionError):
                self.refused += 1
                guest.close()
                host.close()  # what Firecracker does when the guest does not accept
                continue
            host.sendall(b"OK 1073741825\n")
            for a, b_ in ((host, guest), (guest, host)):
                threading.Thread(target=self._pump, args=(a, b_), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.srv.close()


@dataclass
class Guest:
    proc: subprocess.Popen[str]
    muxer: Muxer


@pytest.fixture
def guest() -> Iterator[Guest]:
    if os.geteuid() != 0:
        pytest.skip("runs the agent as nobody: needs root to switch")
    d = Path(tempfile.mkdtemp(prefix="agentbox-vsock-test-"))
    try:
        os.chown(d, NOBODY, NOBODY)
        agent_sock = d / "agent.sock"
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             PYTHON, "-I", "-S", "-c", _DRIVER, agent_module.__file__, str(agent_sock)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d,
        )  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "listening", proc.stderr
        yield Guest(proc, Muxer(d / "v.sock", agent_sock))
    finally:
        with contextlib.suppress(NameError):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        shutil.rmtree(d, ignore_errors=True)


def _session(g: Guest, host: KernelFacts) -> GuestSession:
    sock = connect_vsock(g.muxer.path, 1024, timeout=10, name="t")
    chan = Channel(sock, name="t")
    session = GuestSession(chan, name="t", host=host)
    chan._on_gateway_open = session.on_gateway_open
    return session


# The agent runs on this host, so it reports this host's kernel; a made-up "host" lets
# the per-command check pass, and the real one must make it refuse (next test).
FAKE_HOST = KernelFacts("not-this-release", "not-this-boot")


def test_a_whole_session_over_the_socket_transport(guest: Guest) -> None:
    s = _session(guest, FAKE_HOST)
    ready = s.wait_ready(10)
    assert ready["release"] == os.uname().release
    s.hello(uid=0, mount_data=False, gateway=None, timeout=10)
    s.check()
    env = {"PATH": "/usr/bin:/bin"}
    res = s.exec(["sh", "-c", "echo out; id -u; echo err >&2; exit 3"], env=env, cwd="/",
                 uid=0, timeout=30)  # fmt: skip
    assert (res.exit_code, res.stdout, res.stderr) == (3, f"out\n{NOBODY}\n".encode(), b"err\n")
    big = os.urandom(600_000)
    res = s.exec(["cat"], env=env, cwd="/", uid=0, timeout=30, stdin=big)
    assert res.exit_code == 0 and res.stdout == big
    res = s.exec(["/nonexistent"], env=env, cwd="/", uid=0, timeout=30)
    assert res.exit_code == 127

    # One session per boot: nobody gets a second one while this one is live.
    with pytest.raises(GuestError, match="never accepted"):
        connect_vsock(guest.muxer.path, 1024, timeout=0.5)
    assert guest.muxer.refused >= 1
    assert s.exec(["true"], env=env, cwd="/", uid=0, timeout=30).exit_code == 0

    # The host hangs up: the agent's session ends (in the guest /init then powers off).
    s.channel.close()
    assert guest.proc.wait(15) == 0
    assert guest.proc.stdout is not None and "session over" in guest.proc.stdout.read()


def test_the_kernel_check_runs_over_vsock_too(guest: Guest) -> None:
    s = _session(guest, host_kernel())
    s.wait_ready(10)
    with pytest.raises(GuestError, match="host's kernel"):
        s.hello(uid=0, mount_data=False, gateway=None, timeout=10)
    s.channel.close()


def test_a_host_that_breaks_the_protocol_ends_the_session(guest: Guest) -> None:
    sock = connect_vsock(guest.muxer.path, 1024, timeout=10)
    sock.sendall(b"\xff" * 9)  # an unknown frame type
    t0 = time.monotonic()
    assert guest.proc.wait(15) == 0
    assert time.monotonic() - t0 < 15
    sock.close()
