"""The microVM guest agent: one framed channel between the host and the guest.

It runs inside every qemu/firecracker guest as root, started by the
initramfs's ``/init`` (PID 1) inside the chroot of the image's read-only
root, from a read-only bind of the initramfs (``/opt/agentbox/vm``): the
workload cannot overwrite it. It must run on the image's stdlib ``python3``
and imports nothing of agentbox but its sibling :mod:`agentbox.guest.wire`
(the frames and codec), which the host imports too, so both ends share one
definition of the wire format without the host importing the agent.

Wire format (both directions), on the virtio-serial port ``agentbox.0``::

    frame  = type:u8  stream:u32  length:u32  payload[length]     (big endian)
    CTRL   = 1   payload is one JSON object with an "op"
    STDOUT = 2   STDERR = 3   STDIN = 4   GW = 5   FILE = 6
    a zero-length data frame ends that direction of its stream (EOF)

Host ids (exec, put, get) are even; gateway stream ids chosen by the guest are
odd and increase. A control message goes on the stream it concerns (an ``error``
too); the host breaks the channel on one that arrives where nobody reads.

Gateway streams are flow-controlled: after ``gw_open`` the guest may send
:data:`GW_WINDOW` bytes of GW data on the stream, and more only as the host
grants them (``{"op": "gw_credit", "n": bytes}`` on that stream, sent as it
drains them into the gateway). A guest that sends past its credit breaks the
channel, so the host never holds more than the window per stream.

The session: the guest says ``ready`` (kernel release, boot id), the host
sends ``hello`` (per-run token, clock, RNG seed, whether to mount ``/data``,
the declared read-only mounts as ``[{label, target}]``, the copy-on-write
mounts as ``cow: [{label, target}]`` with their layer's cap ``cow_size``, and the
extra host sockets as ``sockets: [name]``),
and from then on asks ``check`` (a nonce, answered with HMAC(token, nonce),
the kernel release and boot id) before every command. A VM restored from another
live VM's state (``Sandbox.fork``) is greeted already: its host sends ``rekey``
(a new token, clock, RNG seed) instead of ``hello``.
"""

from __future__ import annotations

# ruff: noqa: SIM105 - try/except/pass instead of contextlib.suppress: no contextlib import
# Start-up cost is boot time: under TCG every stdlib module the agent imports
# costs milliseconds to tens of milliseconds (``json`` pulls in ``re`` and
# compiles its patterns, ``subprocess`` and ``socket`` pull in ``enum``, ``hashlib``
# loads OpenSSL: together ~0.5 s of a cold boot). So the agent starts on builtin
# C modules only and imports the rest where it is needed; a snapshot template
# (``agentbox_preload=1``) imports those before it is saved, so restored guests
# never pay for them. See docs/explanation/microvm-isolation.md.
import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only; never imported in the guest
    import socket

# The wire format lives in the sibling wire.py: imported as part of the package
# on the host, as a top-level module next to this file (/opt/agentbox/vm) in the guest.
if __package__:
    from .wire import (
        CTRL,
        DATA_LABEL,
        FILE,
        FRAME_TYPES,
        GW,
        GW_WINDOW,
        HEADER,
        MAX_CTRL,
        MAX_PAYLOAD,
        STDERR,
        STDIN,
        STDOUT,
        FrameReader,
        ProtocolError,
        decode_ctrl,
        encode_ctrl,
        encode_frame,
        proof,
    )
else:  # pragma: no cover - the guest's layout (or the agent loaded from its file by path)
    import sys

    if __file__.rpartition("/")[0] not in sys.path:
        sys.path.insert(0, __file__.rpartition("/")[0])
    from wire import (  # type: ignore[import-not-found,no-redef]
        CTRL,
        DATA_LABEL,  # noqa: F401 - re-exported
        FILE,
        FRAME_TYPES,  # noqa: F401 - re-exported
        GW,
        GW_WINDOW,  # noqa: F401 - re-exported
        HEADER,  # noqa: F401 - re-exported
        MAX_CTRL,  # noqa: F401 - re-exported
        MAX_PAYLOAD,  # noqa: F401 - re-exported
        STDERR,  # noqa: F401 - re-exported
        STDIN,
        STDOUT,  # noqa: F401 - re-exported
        FrameReader,
        ProtocolError,
        decode_ctrl,
        encode_ctrl,  # noqa: F401 - re-exported
        encode_frame,  # noqa: F401 - re-exported
        proof,
    )

if __package__:
    from ._agent_sys import (
        COW_DIR,
        GATEWAY_PORT,
        MOUNT_LABEL_PREFIX,
        PORT_NAME,
        SIGKILL,
        SIGPIPE,
        SIGRTMAX,
        SIGXFSZ,
        SOCKET_DIR,
        UNTAR,
        WORKSPACE,
        _cmdline_flags,
        _find_port,
        _kernel_facts,
        _no_new_privs,
        _preload,
        _reseed,
        _spawn,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from _agent_sys import (  # type: ignore[import-not-found,no-redef]
        COW_DIR,  # noqa: F401 - re-exported
        GATEWAY_PORT,  # noqa: F401 - re-exported
        MOUNT_LABEL_PREFIX,  # noqa: F401 - re-exported
        PORT_NAME,  # noqa: F401 - re-exported
        SIGKILL,
        SIGPIPE,  # noqa: F401 - re-exported
        SIGRTMAX,  # noqa: F401 - re-exported
        SIGXFSZ,  # noqa: F401 - re-exported
        SOCKET_DIR,  # noqa: F401 - re-exported
        UNTAR,  # noqa: F401 - re-exported
        WORKSPACE,  # noqa: F401 - re-exported
        _cmdline_flags,
        _find_port,
        _kernel_facts,
        _no_new_privs,
        _preload,
        _reseed,
        _spawn,  # noqa: F401 - re-exported
    )
if __package__:
    from ._agent_mounts import (
        Mounts,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from _agent_mounts import (  # type: ignore[import-not-found,no-redef]
        Mounts,
    )
if __package__:
    from ._agent_streams import (
        Streams,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from _agent_streams import (  # type: ignore[import-not-found,no-redef]
        Streams,
    )


class Agent(Streams, Mounts):
    """The guest end of the channel: the session, and dispatch to the parts.

    Layout: :mod:`._agent_sys` (helpers, :class:`Channel`: the shared state and
    writes), :mod:`._agent_mounts` (what ``hello`` mounts), :mod:`._agent_streams`
    (exec, files, gateway streams); this module the session, the transports, main.
    """

    def serve(self, *, eof_ends: bool) -> None:
        """Say ``ready``, then dispatch frames until the host hangs up (``eof_ends``)."""
        self.ctrl({"op": "ready", **_kernel_facts()})
        reader = FrameReader()
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                if eof_ends:
                    return
                time.sleep(0.05)  # host not connected (virtio-serial reads 0)
                continue
            for ftype, stream, payload in reader.feed(chunk):
                try:
                    self.dispatch(ftype, stream, payload)
                except Exception as exc:
                    self.ctrl(
                        {"op": "error", "id": stream, "error": f"{type(exc).__name__}: {exc}"},
                        stream,
                    )

    def run(self) -> None:
        """Serve the virtio-serial port (a 0-byte read means no host yet)."""
        self.serve(eof_ends=False)

    def dispatch(self, ftype: int, stream: int, payload: bytes) -> None:
        if ftype == CTRL:
            msg = decode_ctrl(payload)
            op = msg["op"]
            if op == "hello":
                return self.hello(msg)
            if op == "rekey":
                return self.rekey(msg)
            if self.token is None:
                raise ProtocolError("no hello yet")
            handler = getattr(self, "op_" + op, None)
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
            handler(stream, msg)
        elif ftype == STDIN:
            q = self.stdin_q.get(stream)
            if q is not None:
                q.put(payload or None)
        elif ftype == GW:
            gq = self.gw.get(stream)
            if gq is not None:
                gq.put(payload or None)
            if not payload:  # the host is done with the stream: stop sending up it
                credit = self.gw_credit.get(stream)
                if credit is not None:
                    credit.close()
        elif ftype == FILE:
            self.put_chunk(stream, payload)

    # -- session
    def hello(self, msg: dict) -> None:  # type: ignore[type-arg]
        if self.token is not None:
            raise ProtocolError("second hello")
        self.token = str(msg["token"])
        self.uid = int(msg.get("uid", 64000))
        # Inherited by every command: the pids limit counts the sandbox uid's
        # processes at fork (root, the agent, is exempt); nofile as in podman.
        limits = [(key, msg.get(key)) for key in ("pids", "nofile")]
        if any(isinstance(v, int) and v > 0 for _, v in limits):
            import resource

            for key, value in limits:
                if isinstance(value, int) and value > 0:
                    res = resource.RLIMIT_NPROC if key == "pids" else resource.RLIMIT_NOFILE
                    resource.setrlimit(res, (value, value))
        _reseed(bytes.fromhex(msg.get("seed", "")), msg.get("time"))
        if msg.get("mount_data"):
            self.mount_data()
        self.mount_readonly(msg.get("mounts") or [])
        self.mount_cow(msg.get("cow") or [], msg.get("cow_size"))
        if msg.get("gateway"):
            self.start_gateway()
        self.start_sockets(msg.get("sockets") or [])
        self.ctrl({"op": "hello_ok", **_kernel_facts()})

    def rekey(self, msg: dict) -> None:  # type: ignore[type-arg]
        """This VM was restored from another live VM's state (a fork): take a new token,
        clock and RNG seed. The streams of the session it was copied from are cut: their
        processes run on, but their stdin and gateway connections end (the host they
        belonged to is another VM's), and what they still send is dropped by this host,
        which numbers its streams past them."""
        if self.token is None:
            raise ProtocolError("rekey before hello")
        token = str(msg["token"])
        if len(token) < 32:
            raise ProtocolError("short token")
        self.token = token
        for q in list(self.stdin_q.values()):
            q.put(None)
        self.stdin_q.clear()
        for gq in list(self.gw.values()):
            gq.put(None)
        for credit in list(self.gw_credit.values()):
            credit.close()
        _reseed(bytes.fromhex(msg.get("seed", "")), msg.get("time"))
        if msg.get("gateway"):
            self.start_gateway()
        self.ctrl({"op": "rekey_ok", **_kernel_facts()})

    def op_check(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        assert self.token is not None
        nonce = str(msg["nonce"])
        self.ctrl({"op": "check_ok", "nonce": nonce, "proof": proof(self.token, nonce),
                   **_kernel_facts()}, stream)  # fmt: skip

    def op_clock(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        """Set the clock: a VM that was stopped (to be forked) lags by the stop."""
        now = msg.get("time")
        if isinstance(now, (int, float)) and not isinstance(now, bool):
            try:
                time.clock_settime(time.CLOCK_REALTIME, float(now))
            except (OSError, ValueError, OverflowError):
                pass
        self.ctrl({"op": "clock_ok"}, stream)

    def op_shutdown(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        for pid in list(self.procs.values()):
            try:
                os.killpg(pid, SIGKILL)
            except OSError:
                pass
        os.sync()
        self.ctrl({"op": "bye"}, stream)
        os._exit(0)

    def op_sync(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        os.sync()
        self.ctrl({"op": "sync_ok"}, stream)


# ---------------------------------------------------------------- vsock transport
# Firecracker has no virtio-serial, only virtio-vsock. Its backend puts
# ``agentbox_transport=vsock`` on the kernel command line (an underscore, not a dot:
# the kernel keeps dotted words for modules and never hands them to init); the agent
# then listens on AF_VSOCK and the host reaches it through Firecracker's hybrid vsock
# (``CONNECT 1024`` on the VM's unix socket).

#: The guest vsock port the agent listens on.
VSOCK_PORT = 1024


def transport_from_cmdline(cmdline: str) -> str:
    """``"vsock"`` when the kernel command line asks for it, else ``"virtio-serial"``."""
    for word in cmdline.split():
        if word == "agentbox_transport=vsock":
            return "vsock"
    return "virtio-serial"


def listen_vsock(port: int = VSOCK_PORT) -> socket.socket:
    """A listening AF_VSOCK socket on any CID, ``port`` (backlog 1: one host)."""
    import socket

    srv = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    srv.bind((socket.VMADDR_CID_ANY, port))
    srv.listen(1)
    return srv


class SocketAgent(Agent):
    """The agent over a connected stream socket: a 0-byte read means the host hung up.

    (On virtio-serial a 0-byte read only means no host is connected yet, which is
    why :meth:`Agent.run` sleeps and retries; on a socket it is the end.)
    """

    def run(self) -> None:
        """Serve until the host hangs up."""
        self.serve(eof_ends=True)


def serve_one(listener: socket.socket) -> None:
    """Accept one host connection, stop listening, serve it until the host hangs up.

    One session per boot: the listener is closed as soon as the host is in, so
    nobody can open a second session (the per-run token lives in this one), and
    when the host goes away the agent returns and ``/init`` powers the VM off.
    A protocol violation from the host ends the session the same way.
    """
    conn, _ = listener.accept()
    listener.close()
    conn.setblocking(True)
    os.set_inheritable(conn.fileno(), False)
    try:
        SocketAgent(conn.fileno()).run()
    except (OSError, ProtocolError):
        pass
    finally:
        try:
            conn.close()
        except OSError:
            pass


def main() -> None:
    """Open the port, serve until shutdown."""
    # Everything the agent starts inherits no_new_privs: no setuid or file-capability
    # binary in the image can give a workload back what dropping to its uid took away.
    _no_new_privs()
    flags = _cmdline_flags()
    if "agentbox_preload=1" in flags:
        _preload()
    if "agentbox_transport=vsock" in flags:
        serve_one(listen_vsock())
        return  # the host hung up: /init powers the VM off
    fd = os.open(_find_port(), os.O_RDWR | os.O_CLOEXEC)
    Agent(fd).run()


if __name__ == "__main__":
    main()
