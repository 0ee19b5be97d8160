#!/usr/bin/env python3
"""In-sandbox gateway relay: ``127.0.0.1:PORT`` → the mounted gateway unix socket.

Runs inside a podman sandbox (copied into the image as ``/opt/agentbox/relay.py``;
standard library only, no agentbox import). The sandbox has no network but
``lo``; the agent's ``ANTHROPIC_BASE_URL`` points at ``http://127.0.0.1:PORT``
and this shim carries each TCP connection, byte for byte, to a fresh connection
on ``/run/agentbox/gw/gateway.sock``. It parses nothing: the gateway on the host
does all the checking.

Usage::

    relay.py [--port 8080] [--socket PATH] [--max-conns 64] [-- CMD ARGS...]

Without ``CMD`` it serves in the foreground. With ``CMD`` it binds and listens
*first*, forks the server into the background, then ``exec``s ``CMD`` in the
original process, so ``CMD`` never starts before the port accepts connections
and keeps the pid (and the signals tini forwards) it was given; the server is
reparented to init, so CMD never has it as a child.

The server is this program's C twin (``relay.c``, built static into the image
as ``/opt/agentbox/relay``) when the image has it: the server process ``exec``s
it with the listening socket (``--listen-fd``), so no Python interpreter stays
resident in the sandbox (~6 MiB of PSS each). Without it (an image
built before), this file serves.

Each connection gets two pumps (one per direction), each copying through its
own reused buffer (``recv_into``, no allocation per chunk). When one side ends its
stream, the other side's write half is shut down (half-close), so a client that
sends its request and then ``shutdown(SHUT_WR)`` still gets its answer. At most
``--max-conns`` connections are relayed at once; further ones wait in the
listen backlog rather than exhausting threads or file descriptors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading

DEFAULT_PORT = 8080
DEFAULT_SOCKET = "/run/agentbox/gw/gateway.sock"
CHUNK = 128 * 1024  # per direction and connection; measured in bench/egress.py
#: The C twin of this program, installed next to it by the image build.
NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay")


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` → ``dst`` until EOF, then half-close ``dst``'s write side."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(view[:n])
    except OSError:
        # A reset on either side ends both directions.
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _serve_one(client: socket.socket, path: str, slots: threading.BoundedSemaphore) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            upstream.connect(path)
        except OSError:
            return  # no gateway: the client sees the connection close
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
    finally:
        upstream.close()
        client.close()
        slots.release()


def serve(listener: socket.socket, path: str, max_conns: int) -> None:
    """Accept forever; relay each connection to a new connection on ``path``."""
    threading.stack_size(256 * 1024)
    slots = threading.BoundedSemaphore(max_conns)
    while True:
        slots.acquire()
        try:
            client, _ = listener.accept()
        except OSError:
            slots.release()
            continue
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_one, args=(client, path, slots), daemon=True).start()


def serve_native(listener: socket.socket, path: str, max_conns: int) -> None:
    """Become the C relay serving ``listener`` when the image has it; else return."""
    if not os.access(NATIVE, os.X_OK):
        return
    fd = listener.fileno()
    os.set_inheritable(fd, True)
    argv = [NATIVE, "--listen-fd", str(fd), "--socket", path, "--max-conns", str(max_conns)]
    with contextlib.suppress(OSError):  # cannot run it: serve in Python
        os.execv(NATIVE, argv)
    os.set_inheritable(fd, False)


def listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` (loopback only)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(128)
    return s


def _detach_stdio() -> None:
    # The server must not write into (or hold open) the workload's stdout/stderr.
    fd = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fd, target)
    if fd > 2:
        os.close(fd)


def main(argv: list[str]) -> int:
    """Parse ``argv`` and serve, or listen, fork the server and exec the command."""
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="relay.py", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--max-conns", type=int, default=64)
    args = p.parse_args(argv)
    if not 1 <= args.max_conns <= 1024:
        p.error("--max-conns must be within 1..1024")
    try:
        listener = listen(args.port)
    except OSError as exc:
        print(f"relay: cannot listen on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
        return 1
    if not cmd:
        serve_native(listener, args.socket, args.max_conns)
        serve(listener, args.socket, args.max_conns)
        return 0
    # Double fork: the server ends up a child of init (tini), not of CMD, so a
    # CMD that waits for all its children never waits for the relay.
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:  # the server
                os.setsid()
                _detach_stdio()
                serve_native(listener, args.socket, args.max_conns)
                serve(listener, args.socket, args.max_conns)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    listener.close()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"relay: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
