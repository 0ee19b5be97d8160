"""The microVM guest agent: one framed channel between the host and the guest.

It runs inside every qemu/firecracker guest as root, started by the
initramfs's ``/init`` (PID 1) inside the chroot of the image's read-only
root, from a read-only bind of the initramfs (``/opt/agentbox/vm``): the
workload cannot overwrite it. It must run on the image's stdlib ``python3``
and imports nothing of agentbox; the host imports the frame helpers from this
same file, so both ends share one definition of the wire format.

Wire format (both directions), on the virtio-serial port ``agentbox.0``::

    frame  = type:u8  stream:u32  length:u32  payload[length]     (big endian)
    CTRL   = 1   payload is one JSON object with an "op"
    STDOUT = 2   STDERR = 3   STDIN = 4   GW = 5   FILE = 6
    a zero-length data frame ends that direction of its stream (EOF)

Host ids (exec, put, get) are even; gateway stream ids chosen by the guest are
odd. The session: the guest says ``ready`` (kernel release, boot id), the host
sends ``hello`` (per-run token, clock, RNG seed, whether to mount ``/data``),
and from then on asks ``check`` (a nonce, answered with HMAC(token, nonce),
the kernel release and boot id) before every command.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import hmac
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import threading
import time

CTRL, STDOUT, STDERR, STDIN, GW, FILE = 1, 2, 3, 4, 5, 6
FRAME_TYPES = frozenset({CTRL, STDOUT, STDERR, STDIN, GW, FILE})
HEADER = struct.Struct(">BII")
#: Largest payload either side accepts; bigger is a protocol violation.
MAX_PAYLOAD = 256 * 1024
#: Largest JSON control payload.
MAX_CTRL = 64 * 1024
PORT_NAME = "agentbox.0"
GATEWAY_PORT = 8080
DATA_LABEL = "agentbox-data"


class ProtocolError(Exception):
    """A frame that breaks the wire format."""


def encode_frame(ftype: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame, header and payload."""
    if ftype not in FRAME_TYPES:
        raise ProtocolError(f"unknown frame type {ftype}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(ftype, stream, len(payload)) + payload


def encode_ctrl(msg: dict, stream: int = 0) -> bytes:  # type: ignore[type-arg]
    """A CTRL frame carrying ``msg`` as JSON."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_CTRL:
        raise ProtocolError("control message too large")
    return encode_frame(CTRL, stream, data)


class FrameReader:
    """Incremental, defensive frame parser: feed bytes, get whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """Append ``data``; return the frames it completed. Raises ProtocolError."""
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            ftype, stream, length = HEADER.unpack_from(self._buf)
            if ftype not in FRAME_TYPES:
                raise ProtocolError(f"unknown frame type {ftype}")
            limit = MAX_CTRL if ftype == CTRL else MAX_PAYLOAD
            if length > limit:
                raise ProtocolError(f"frame of {length} bytes exceeds {limit}")
            if len(self._buf) < HEADER.size + length:
                break
            payload = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            out.append((ftype, stream, payload))
        return out


def decode_ctrl(payload: bytes) -> dict:  # type: ignore[type-arg]
    """Parse a CTRL payload: a JSON object with a string ``op``."""
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"control frame is not JSON: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("control frame is not an object with an op")
    return msg


def proof(token: str, nonce: str) -> str:
    """What the guest answers to a nonce: HMAC-SHA256(token, nonce)."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


# ---------------------------------------------------------------- guest side


def _kernel_facts() -> dict:  # type: ignore[type-arg]
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return {"release": os.uname().release, "boot_id": boot_id}


def _find_port() -> str:
    base = "/sys/class/virtio-ports"
    for _ in range(200):
        with contextlib.suppress(OSError):
            for dev in sorted(os.listdir(base)):
                with open(f"{base}/{dev}/name") as f:
                    if f.read().strip() == PORT_NAME:
                        return f"/dev/{dev}"
        time.sleep(0.05)
    raise SystemExit(f"agent: no virtio port named {PORT_NAME}")


def _find_label(label: str) -> str | None:
    for dev in sorted(os.listdir("/sys/block")):
        if not dev.startswith("vd"):
            continue
        try:
            with open(f"/dev/{dev}", "rb") as f:
                f.seek(1024)
                sb = f.read(1024)
        except OSError:
            continue
        if sb[56:58] == b"\x53\xef" and sb[120:136].rstrip(b"\0").decode(errors="replace") == label:
            return f"/dev/{dev}"
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    if _libc.mount(src.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {target}: {os.strerror(err)}")


def _reseed(seed: bytes, now: float | None) -> None:
    # RNDADDENTROPY credits the entropy; after a snapshot restore every clone
    # starts from the same RNG state, so this is what makes them diverge.
    rnd_add_entropy = 0x40085203
    with contextlib.suppress(OSError), open("/dev/urandom", "wb") as f:
        fcntl.ioctl(f, rnd_add_entropy, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
    if now is not None:

        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        ts = Timespec(int(now), int((now % 1) * 1e9))
        _libc.clock_settime(0, ctypes.byref(ts))


class Agent:
    """The guest end of the channel."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.wlock = threading.Lock()
        self.token: str | None = None
        self.uid = 64000
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stdin_q: dict[int, queue.Queue[bytes | None]] = {}
        self.gw: dict[int, queue.Queue[bytes | None]] = {}
        self.puts: dict[int, tuple[int, str]] = {}
        self.next_gw = 1
        self.lock = threading.Lock()
        self.gateway_started = False

    # -- io
    def send(self, data: bytes) -> None:
        with self.wlock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]

    def ctrl(self, msg: dict, stream: int = 0) -> None:  # type: ignore[type-arg]
        self.send(encode_ctrl(msg, stream))

    def data(self, ftype: int, stream: int, chunk: bytes) -> None:
        for i in range(0, max(len(chunk), 1), MAX_PAYLOAD):
            self.send(encode_frame(ftype, stream, chunk[i : i + MAX_PAYLOAD]))

    def run(self) -> None:
        self.ctrl({"op": "ready", **_kernel_facts()})
        reader = FrameReader()
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                time.sleep(0.05)  # host not connected (virtio-serial reads 0)
                continue
            for ftype, stream, payload in reader.feed(chunk):
                try:
                    self.dispatch(ftype, stream, payload)
                except Exception as exc:
                    self.ctrl(
                        {"op": "error", "id": stream, "error": f"{type(exc).__name__}: {exc}"}
                    )

    def dispatch(self, ftype: int, stream: int, payload: bytes) -> None:
        if ftype == CTRL:
            msg = decode_ctrl(payload)
            op = msg["op"]
            if op == "hello":
                return self.hello(msg)
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
        import resource

        for res, key in ((resource.RLIMIT_NPROC, "pids"), (resource.RLIMIT_NOFILE, "nofile")):
            if isinstance(msg.get(key), int) and msg[key] > 0:
                resource.setrlimit(res, (msg[key], msg[key]))
        _reseed(bytes.fromhex(msg.get("seed", "")), msg.get("time"))
        if msg.get("mount_data"):
            self.mount_data()
        if msg.get("gateway"):
            self.start_gateway()
        self.ctrl({"op": "hello_ok", **_kernel_facts()})

    def mount_data(self) -> None:
        dev = _find_label(DATA_LABEL)
        if dev is None:
            raise OSError("no /data disk")
        with open(dev, "rb") as f:
            # Drop whatever a snapshot's template cached of the placeholder disk.
            fcntl.ioctl(f, 0x1261)  # BLKFLSBUF
        # commit=1: the journal commits every second (default 5), so a VM killed from
        # outside (deadline, launcher crash) loses at most ~1 s of the agent's writes
        # when the host reads the disk back.
        _mount(dev, "/workspace", "ext4", 0x2 | 0x4, "commit=1")  # MS_NOSUID | MS_NODEV
        # mkfs.ext4 made it; the workspace should look exactly like the host's copy.
        with contextlib.suppress(OSError):
            os.rmdir("/workspace/lost+found")
        if os.lstat("/workspace").st_uid != self.uid:
            # The host's copy carries host ids; in here it all belongs to the sandbox uid.
            for root, dirs, files in os.walk("/workspace"):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    with contextlib.suppress(OSError):
                        if os.lstat(p).st_uid != self.uid:
                            os.lchown(p, self.uid, self.uid)
            os.lchown("/workspace", self.uid, self.uid)

    def op_check(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        assert self.token is not None
        nonce = str(msg["nonce"])
        self.ctrl({"op": "check_ok", "nonce": nonce, "proof": proof(self.token, nonce),
                   **_kernel_facts()}, stream)  # fmt: skip

    def op_shutdown(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        for p in list(self.procs.values()):
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
        os.sync()
        self.ctrl({"op": "bye"}, stream)
        os._exit(0)

    def op_sync(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        os.sync()
        self.ctrl({"op": "sync_ok"}, stream)

    # -- exec
    def op_exec(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        argv = [str(a) for a in msg["argv"]]
        env = {str(k): str(v) for k, v in dict(msg.get("env") or {}).items()}
        uid = int(msg.get("uid", self.uid))
        cwd = str(msg.get("cwd") or "/")

        drop = uid != 0
        try:
            # no_new_privs is already set on the agent (inherited); the ids are
            # dropped by subprocess itself, so the child runs no Python before exec.
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.PIPE if msg.get("stdin") else
                subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, user=uid if drop else None,
                group=uid if drop else None, extra_groups=[] if drop else None,
            )  # fmt: skip
        except OSError as exc:
            self.ctrl({"op": "exit", "code": 127, "error": str(exc)}, stream)
            return
        self.procs[stream] = proc
        if proc.stdin is not None:
            q: queue.Queue[bytes | None] = queue.Queue()
            self.stdin_q[stream] = q
            threading.Thread(target=self._feed, args=(proc, q), daemon=True).start()
        pumps = [
            threading.Thread(target=self._pump, args=(proc.stdout, STDOUT, stream), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, STDERR, stream), daemon=True),
        ]
        for t in pumps:
            t.start()
        threading.Thread(target=self._reap, args=(proc, pumps, stream), daemon=True).start()
        self.ctrl({"op": "started", "pid": proc.pid}, stream)

    def _feed(self, proc: subprocess.Popen[bytes], q: queue.Queue[bytes | None]) -> None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            while (chunk := q.get()) is not None:
                proc.stdin.write(chunk)
                proc.stdin.flush()
        with contextlib.suppress(OSError):
            proc.stdin.close()

    def _pump(self, pipe, ftype: int, stream: int) -> None:  # type: ignore[no-untyped-def]
        while chunk := os.read(pipe.fileno(), MAX_PAYLOAD):
            self.send(encode_frame(ftype, stream, chunk))
        self.send(encode_frame(ftype, stream, b""))

    def _reap(
        self, proc: subprocess.Popen[bytes], pumps: list[threading.Thread], stream: int
    ) -> None:
        code = proc.wait()
        for t in pumps:
            t.join()
        self.procs.pop(stream, None)
        self.stdin_q.pop(stream, None)
        self.ctrl({"op": "exit", "code": code}, stream)

    def op_signal(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        proc = self.procs.get(stream)
        sig = int(msg["sig"])
        if proc is not None and sig in {s.value for s in signal.Signals}:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)

    # -- files: tar streams, extracted/created by the image's python in-guest
    def op_put(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        r, w = os.pipe()
        dest = str(msg["dest"])
        self.puts[stream] = (w, dest)
        threading.Thread(target=self._untar, args=(r, dest, stream), daemon=True).start()

    def put_chunk(self, stream: int, chunk: bytes) -> None:
        ent = self.puts.get(stream)
        if ent is None:
            return
        w = ent[0]
        if not chunk:
            os.close(w)
            self.puts.pop(stream, None)
            return
        with contextlib.suppress(OSError):
            os.write(w, chunk)

    def _untar(self, r: int, dest: str, stream: int) -> None:
        import tarfile

        err = ""
        try:
            with os.fdopen(r, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tf:
                os.makedirs(dest, exist_ok=True)
                for m in tf:
                    if m.name.startswith("/") or ".." in m.name.split("/"):
                        continue
                    m.uid = m.gid = self.uid
                    tf.extract(m, dest, set_attrs=True)
                    with contextlib.suppress(OSError):
                        os.lchown(os.path.join(dest, m.name), self.uid, self.uid)
            with contextlib.suppress(OSError):
                st = os.lstat(dest)
                if st.st_uid == 0 and dest.startswith("/workspace"):
                    os.lchown(dest, self.uid, self.uid)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        self.ctrl({"op": "put_ok", "error": err}, stream)

    def op_get(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        threading.Thread(target=self._tar, args=(str(msg["src"]), stream), daemon=True).start()

    def _tar(self, src: str, stream: int) -> None:
        import tarfile

        class Sink:
            def write(s, b: bytes) -> int:
                for i in range(0, len(b), MAX_PAYLOAD):
                    self.send(encode_frame(FILE, stream, bytes(b[i : i + MAX_PAYLOAD])))
                return len(b)

        err = ""
        try:
            if not os.path.lexists(src):
                raise FileNotFoundError(src)
            with tarfile.open(fileobj=Sink(), mode="w|", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]
                tf.add(src, arcname=os.path.basename(src.rstrip("/")) or ".", recursive=True)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        self.send(encode_frame(FILE, stream, b""))
        self.ctrl({"op": "get_ok", "error": err}, stream)

    # -- gateway streams
    def start_gateway(self) -> None:
        if self.gateway_started:
            return
        self.gateway_started = True
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", GATEWAY_PORT))
        srv.listen(64)
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            conn, _ = srv.accept()
            with self.lock:
                sid = self.next_gw
                self.next_gw += 2
            q: queue.Queue[bytes | None] = queue.Queue()
            self.gw[sid] = q
            self.ctrl({"op": "gw_open"}, sid)
            down = threading.Thread(target=self._gw_down, args=(conn, sid, q), daemon=True)
            down.start()
            threading.Thread(target=self._gw_up, args=(conn, sid, down), daemon=True).start()

    def _gw_up(self, conn: socket.socket, sid: int, down: threading.Thread) -> None:
        with contextlib.suppress(OSError):
            while chunk := conn.recv(MAX_PAYLOAD):
                self.send(encode_frame(GW, sid, chunk))
        self.send(encode_frame(GW, sid, b""))
        down.join()
        conn.close()

    def _gw_down(self, conn: socket.socket, sid: int, q: queue.Queue[bytes | None]) -> None:
        with contextlib.suppress(OSError):
            while (chunk := q.get()) is not None:
                conn.sendall(chunk)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
        self.gw.pop(sid, None)


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
        self.ctrl({"op": "ready", **_kernel_facts()})
        reader = FrameReader()
        while chunk := os.read(self.fd, 65536):
            for ftype, stream, payload in reader.feed(chunk):
                try:
                    self.dispatch(ftype, stream, payload)
                except Exception as exc:
                    self.ctrl(
                        {"op": "error", "id": stream, "error": f"{type(exc).__name__}: {exc}"}
                    )


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
        with contextlib.suppress(OSError):
            conn.close()


def _transport() -> str:
    try:
        with open("/proc/cmdline") as f:
            return transport_from_cmdline(f.read())
    except OSError:
        return "virtio-serial"


def main() -> None:
    """Open the port, serve until shutdown."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # Everything the agent starts inherits no_new_privs: no setuid or file-capability
    # binary in the image can give a workload back what dropping to its uid took away.
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit("agent: cannot set no_new_privs")
    if _transport() == "vsock":
        serve_one(listen_vsock())
        return  # the host hung up: /init powers the VM off
    fd = os.open(_find_port(), os.O_RDWR)
    os.set_inheritable(fd, False)
    Agent(fd).run()


if __name__ == "__main__":
    main()
