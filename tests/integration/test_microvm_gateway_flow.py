"""Gateway streams end to end with the real guest agent: credit-based flow control.

The real ``agent.py`` runs in its own process as ``nobody``, in a network
namespace of its own (so its gateway listener on 127.0.0.1:8080 is its own, as
in a guest), serving one session on an AF_UNIX listener (the guest's transports
are virtio-serial and vsock; the session code is the same). The host is the real
``Channel`` and ``GuestSession``; the gateway is a unix socket server that, like
uvicorn behind a pipelined request, stops reading one connection while it still
answers others. The workload floods that connection: the host must hold no more
than the stream's window while the other connections are still served.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends.microvm._channel import Channel
from agentbox.backends.microvm._guest import GuestSession, KernelFacts
from agentbox.guest import agent as agent_module
from agentbox.guest.agent import GW_WINDOW

NOBODY = 65534
PYTHON = "/usr/bin/python3"
MIB = 1024 * 1024
FAKE_HOST = KernelFacts("not-this-release", "not-this-boot")

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
"""

#: The workload: one connection sends a request the gateway stalls on, then pushes
#: FLOOD more bytes behind it; meanwhile other connections ask and must be answered.
FLOOD_MIB = 512
WORKLOAD = f"""
import socket, sys, threading
pushed = [0]
def flood():
    s = socket.create_connection(("127.0.0.1", 8080))
    s.sendall(b"SLOW\\n")
    s.settimeout(8)
    block = b"z" * (1 << 20)
    try:
        for _ in range({FLOOD_MIB}):
            s.sendall(block)
            pushed[0] += len(block)
    except OSError:
        pass
    print("pushed", pushed[0], flush=True)
t = threading.Thread(target=flood)
t.start()
for i in range(3):
    c = socket.create_connection(("127.0.0.1", 8080), timeout=60)
    c.sendall(b"hi-%d\\n" % i)
    print(c.makefile("rb").readline().decode().strip(), flush=True)
    c.close()
t.join()
"""


class Gateway:
    """Answers ``echo:<line>``, except a ``SLOW`` connection, which it stops reading."""

    def __init__(self, path: Path) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(64)
        self.stalled: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n"):
            b = conn.recv(1)
            if not b:
                conn.close()
                return
            line += b
        if line == b"SLOW\n":
            self.stalled.append(conn)  # held open, never read again
            return
        conn.sendall(b"echo:" + line)
        conn.close()

    def close(self) -> None:
        self.srv.close()
        for c in self.stalled:
            c.close()


@pytest.fixture
def session() -> Iterator[tuple[GuestSession, Gateway]]:
    if os.geteuid() != 0:
        pytest.skip("runs the agent as nobody in its own network namespace: needs root")
    d = Path(tempfile.mkdtemp(prefix="agentbox-gwflow-test-"))
    proc: subprocess.Popen[str] | None = None
    chan: Channel | None = None
    gw: Gateway | None = None
    try:
        os.chmod(d, 0o755)
        os.chown(d, NOBODY, NOBODY)
        sock_path = d / "agent.sock"
        run_agent = (
            f"ip link set lo up && exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups"
            f' {PYTHON} -I -S -c "$0" "$1" "$2"'
        )
        proc = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", run_agent, _DRIVER, agent_module.__file__,
             str(sock_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d,
        )  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "listening", proc.stderr
        gw = Gateway(d / "gateway.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(sock_path))
        chan = Channel(sock, name="gwflow")
        s = GuestSession(chan, name="gwflow", host=FAKE_HOST)
        chan._on_gateway_open = s.on_gateway_open
        s.wait_ready(10)
        s.hello(uid=0, mount_data=False, gateway=d / "gateway.sock", timeout=10)
        yield s, gw
    finally:
        if chan is not None:
            chan.close()
        if gw is not None:
            gw.close()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        shutil.rmtree(d, ignore_errors=True)


def test_a_flood_behind_a_stalled_request_stays_in_the_guest(
    session: tuple[GuestSession, Gateway],
) -> None:
    s, _ = session
    before = psutil.Process().memory_info().rss
    peak = [before]
    held = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], psutil.Process().memory_info().rss)
            held[0] = max(held[0], s.gateway_held)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        res = s.exec([PYTHON, "-c", WORKLOAD], env={"PATH": "/usr/bin:/bin"}, cwd="/", uid=0,
                     timeout=120)  # fmt: skip
    finally:
        stop.set()
        t.join()
    out = res.stdout.decode().splitlines()
    assert res.exit_code == 0, res.stderr
    # the other requests of the task were served while the flood was held back
    assert [ln for ln in out if ln.startswith("echo:")] == ["echo:hi-0", "echo:hi-1", "echo:hi-2"]
    pushed = int(next(ln for ln in out if ln.startswith("pushed")).split()[1])
    print(f"pushed {pushed} B, host held at most {held[0]} B, RSS +{peak[0] - before} B")
    assert pushed < FLOOD_MIB * MIB // 4, "the workload's sends must block, not reach the host"
    assert held[0] <= GW_WINDOW
    assert peak[0] - before < 48 * MIB
    assert not s.channel.broken
