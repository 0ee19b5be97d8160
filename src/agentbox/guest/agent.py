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
the kernel release and boot id) before every command.
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
import _thread
import fcntl
import os
import struct
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only; never imported in the guest
    import socket
    from _queue import SimpleQueue
    from typing import Any

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
        DATA_LABEL,
        FILE,
        FRAME_TYPES,  # noqa: F401 - re-exported
        GW,
        GW_WINDOW,
        HEADER,  # noqa: F401 - re-exported
        MAX_CTRL,  # noqa: F401 - re-exported
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

PORT_NAME = "agentbox.0"
GATEWAY_PORT = 8080
MOUNT_LABEL_PREFIX = "agentbox-m"
WORKSPACE = "/workspace"
#: Where the extra host sockets appear (the container layout's gateway dir).
SOCKET_DIR = "/run/agentbox/gw"
#: The copy-on-write mounts' lower disks and their tmpfs layer (root's, 0700).
COW_DIR = "/run/agentbox/cow"
MS_RDONLY, MS_NOSUID, MS_NODEV = 0x1, 0x2, 0x4
SIGKILL, SIGPIPE, SIGXFSZ = 9, 13, 25
#: Largest signal number a host may ask the agent to send.
SIGRTMAX = 64


#: What a ``put`` runs, as the sandbox uid: extract the tar on stdin into argv[1]
#: with the rules of tarfile's "data" filter, spelled out because the guest's
#: Python (Debian 12's 3.11.2) predates ``tarfile.data_filter``: a member must
#: stay inside the destination (its name and, for links, its target, resolved
#: through whatever is on disk), links are relative, no devices or FIFOs, no
#: setuid/setgid/sticky or group/other write bits. A member that breaks a rule
#: fails the copy and names the member.
UNTAR = r"""
import os, sys, tarfile
try:
    dest = sys.argv[1]
    os.makedirs(dest, exist_ok=True)
    root = os.path.realpath(dest)
    def inside(path):
        path = os.path.realpath(path)
        return path == root or path.startswith(root.rstrip("/") + "/")
    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tf:
        for m in tf:
            name = m.name.lstrip("/")
            if m.name != name or not inside(os.path.join(root, name)):
                raise ValueError("%r would land outside %s" % (m.name, dest))
            if m.islnk() or m.issym():
                if m.linkname.startswith("/"):
                    raise ValueError("%r links to an absolute path" % m.name)
                base = os.path.dirname(name) if m.issym() else ""
                if not inside(os.path.join(root, base, m.linkname)):
                    raise ValueError("%r links outside %s" % (m.name, dest))
            elif not (m.isreg() or m.isdir()):
                raise ValueError("%r is a special file" % m.name)
            mode = m.mode & 0o755
            if m.isreg() or m.islnk():
                if not mode & 0o100:
                    mode &= ~0o111
                mode |= 0o600
            elif m.isdir():
                mode |= 0o700
            m.mode = mode
            m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
            tf.extract(m, root, set_attrs=True, **kw)
except Exception as exc:
    sys.stderr.write("%s: %s\n" % (type(exc).__name__, exc))
    sys.exit(1)
"""


# ---------------------------------------------------------------- guest side


def _kernel_facts() -> dict:  # type: ignore[type-arg]
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return {"release": os.uname().release, "boot_id": boot_id}


def _cmdline_flags() -> set[str]:
    try:
        with open("/proc/cmdline") as f:
            return set(f.read().split())
    except OSError:
        return set()


def _find_port() -> str:
    base = "/sys/class/virtio-ports"
    for _ in range(400):
        try:
            for dev in sorted(os.listdir(base)):
                with open(f"{base}/{dev}/name") as f:
                    if f.read().strip() == PORT_NAME:
                        return f"/dev/{dev}"
        except OSError:
            pass
        time.sleep(0.01)
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


def _libc() -> tuple[Any, Any]:
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _mount(src: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    ctypes, libc = _libc()
    if libc.mount(src.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {target}: {os.strerror(err)}")


def _no_new_privs() -> None:
    # /init starts the agent under ``setpriv --nnp``; prctl is the fallback (ctypes).
    with open("/proc/self/status") as f:
        if "NoNewPrivs:\t1" in f.read():
            return
    _, libc = _libc()
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit("agent: cannot set no_new_privs")


def _preload() -> None:
    # A snapshot template imports now what a session may need later, so that
    # restored guests never pay for it (see the note at the imports).
    import ctypes  # noqa: F401
    import resource  # noqa: F401
    import socket  # noqa: F401
    import tarfile  # noqa: F401
    from _queue import SimpleQueue  # noqa: F401


def _reseed(seed: bytes, now: float | None) -> None:
    # RNDADDENTROPY credits the entropy; after a snapshot restore every clone
    # starts from the same RNG state, so this is what makes them diverge.
    rnd_add_entropy = 0x40085203
    try:
        with open("/dev/urandom", "wb") as f:
            fcntl.ioctl(f, rnd_add_entropy, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
    except OSError:
        pass
    if now is not None:
        try:
            time.clock_settime(time.CLOCK_REALTIME, float(now))
        except (OSError, ValueError, OverflowError):
            pass


def _spawn(
    argv: list[str], env: dict[str, str], cwd: str, uid: int | None, fds: tuple[int, int, int]
) -> int:
    """fork + exec ``argv`` in a new session with ``fds`` as 0, 1, 2, as ``uid`` if given.

    The child runs only ``os`` calls before exec, no Python that takes a lock
    another thread may hold; a failure before exec is reported through a
    close-on-exec pipe and raised here as OSError, as subprocess would.
    """
    import _signal  # type: ignore[import-not-found,unused-ignore]

    err_r, err_w = os.pipe()  # both close-on-exec
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            # Python ignores these; a command expects the defaults.
            _signal.signal(SIGPIPE, _signal.SIG_DFL)
            _signal.signal(SIGXFSZ, _signal.SIG_DFL)
            os.chdir(cwd)
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:
            errno = exc.errno if isinstance(exc, OSError) and exc.errno else 0
            try:
                os.write(err_w, f"{errno}:{exc}".encode(errors="replace")[:1000])
            finally:
                os._exit(127)
    os.close(err_w)
    try:
        report = b""
        while chunk := os.read(err_r, 1024):
            report += chunk
    finally:
        os.close(err_r)
    if report:
        os.waitpid(pid, 0)
        code, _, text = report.decode(errors="replace").partition(":")
        raise OSError(int(code) if code.isdigit() else 0, text)
    return pid


class _Credit:
    """Bytes one gateway stream may still send up; ``wait`` blocks until there are some."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False
        self.lock = _thread.allocate_lock()
        self.wake = _thread.allocate_lock()  # released when credit arrives or on close
        self.wake.acquire()

    def add(self, n: int) -> None:
        with self.lock:
            self.n += n
            if self.wake.locked():
                self.wake.release()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.wake.locked():
                self.wake.release()

    def wait(self) -> int:
        """The credit left, once there is some; 0 once the stream is closed."""
        while True:
            with self.lock:
                if self.closed:
                    return 0
                if self.n > 0:
                    return self.n
            self.wake.acquire()

    def spend(self, n: int) -> None:
        with self.lock:
            self.n -= n


class Agent:
    """The guest end of the channel."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.wlock = _thread.allocate_lock()
        self.token: str | None = None
        self.uid = 64000
        self.procs: dict[int, int] = {}  # stream -> pid (the process group)
        self.stdin_q: dict[int, SimpleQueue[bytes | None]] = {}
        self.gw: dict[int, SimpleQueue[bytes | None]] = {}
        self.gw_credit: dict[int, _Credit] = {}
        self.puts: dict[int, tuple[int, str]] = {}
        self.next_gw = 1
        self.lock = _thread.allocate_lock()
        self.gateway_started = False
        self.cow_targets: list[str] = []

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

    def mount_data(self) -> None:
        # A cold boot's /init has mounted it already (agentbox_data=1); a restored
        # snapshot's template never did, and the disk under it was swapped.
        if not os.path.ismount(WORKSPACE):
            dev = _find_label(DATA_LABEL)
            if dev is None:
                raise OSError("no /data disk")
            with open(dev, "rb") as f:
                # Drop whatever a snapshot's template cached of the placeholder disk.
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF
            # commit=1: the journal commits every second (default 5), so a VM killed
            # from outside (deadline, launcher crash) loses at most ~1 s of the
            # agent's writes when the host reads the disk back.
            _mount(dev, WORKSPACE, "ext4", 0x2 | 0x4, "commit=1")  # MS_NOSUID | MS_NODEV
        # mkfs.ext4 made it; the workspace should look exactly like the host's copy.
        try:
            os.rmdir(WORKSPACE + "/lost+found")
        except OSError:
            pass
        if os.lstat(WORKSPACE).st_uid != self.uid:
            # The host's copy carries host ids; in here it all belongs to the sandbox uid.
            for root, dirs, files in os.walk(WORKSPACE):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    try:
                        if os.lstat(p).st_uid != self.uid:
                            os.lchown(p, self.uid, self.uid)
                    except OSError:
                        pass
            os.lchown(WORKSPACE, self.uid, self.uid)

    def mount_readonly(self, mounts: list) -> None:  # type: ignore[type-arg]
        # Declared mounts, before any command runs: each is a disk QEMU attached
        # read-only, found by its label. No workload has run yet, so nothing in
        # /tmp or /home/agent can be a planted link on the way to a target.
        for m in mounts:
            label, target = str(m["label"]), str(m["target"])
            if not label.startswith(MOUNT_LABEL_PREFIX) or not target.startswith("/"):
                raise ProtocolError(f"bad mount {label!r} on {target!r}")
            dev = _find_label(label)
            if dev is None:
                raise OSError(f"no disk labelled {label}")
            with open(dev, "rb") as f:
                # A restored snapshot's template cached its placeholder: drop that,
                # then make sure the label is still there on the real disk.
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF
            if _find_label(label) != dev:
                raise OSError(f"{dev} lost its label {label} after the flush")
            # A target under a tmpfs (/tmp, /home/agent) is made here; the host
            # checked that any other target is a directory in the image.
            os.makedirs(target, 0o755, exist_ok=True)
            # MS_RDONLY | MS_NOSUID | MS_NODEV; noload: never replay a journal.
            _mount(dev, target, "ext4", 0x1 | 0x2 | 0x4, "noload")

    def mount_cow(self, mounts: list, size: object) -> None:  # type: ignore[type-arg]
        # Copy-on-write mounts (a frozen environment): each disk read-only as the
        # lower layer of an overlay at its target; the upper layers live on one
        # tmpfs of at most ``size`` bytes, so what the workload writes there is
        # bounded (ENOSPC past it) and dropped with the VM; the disk never changes.
        if not mounts:
            return
        if type(size) is not int or size <= 0:
            raise ProtocolError(f"bad cow size {size!r}")
        os.makedirs(COW_DIR, 0o700, exist_ok=True)
        _mount("tmpfs", COW_DIR, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0700")
        for m in mounts:
            label, target = str(m["label"]), str(m["target"])
            if not label.startswith(MOUNT_LABEL_PREFIX) or not target.startswith("/"):
                raise ProtocolError(f"bad cow mount {label!r} on {target!r}")
            dev = _find_label(label)
            if dev is None:
                raise OSError(f"no disk labelled {label}")
            with open(dev, "rb") as f:
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF (see mount_readonly)
            if _find_label(label) != dev:
                raise OSError(f"{dev} lost its label {label} after the flush")
            lower, upper, work = (f"{COW_DIR}/{label}.{x}" for x in ("lower", "upper", "work"))
            for d in (lower, upper, work):
                os.mkdir(d, 0o755)
            _mount(dev, lower, "ext4", MS_RDONLY | MS_NOSUID | MS_NODEV, "noload")
            # The overlay's root takes the upper dir's owner and mode: the lower root's.
            st = os.stat(lower)
            os.chown(upper, st.st_uid, st.st_gid)
            os.chmod(upper, st.st_mode & 0o777)
            self._make_dirs(target)
            opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
            _mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts)
            self.cow_targets.append(target)

    def _make_dirs(self, target: str) -> None:
        # Each component a directory, never a link: /workspace is the repo's (the
        # host made the mount point; a repo's link there must not lead the mount).
        import stat as _stat

        path = ""
        for part in target.strip("/").split("/"):
            if part in ("", ".", ".."):
                raise ProtocolError(f"bad mount target {target!r}")
            path += "/" + part
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                if path.startswith((WORKSPACE + "/", "/home/agent/")):
                    os.lchown(path, self.uid, self.uid)
                continue
            if not _stat.S_ISDIR(mode):
                raise OSError(f"mount target {target}: {path} is not a directory")

    def op_check(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        assert self.token is not None
        nonce = str(msg["nonce"])
        self.ctrl({"op": "check_ok", "nonce": nonce, "proof": proof(self.token, nonce),
                   **_kernel_facts()}, stream)  # fmt: skip

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

    # -- exec
    def op_exec(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        argv = [str(a) for a in msg["argv"]]
        if not argv:
            raise ProtocolError("empty argv")
        env = {str(k): str(v) for k, v in dict(msg.get("env") or {}).items()}
        uid = int(msg.get("uid", self.uid))
        cwd = str(msg.get("cwd") or "/")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if msg.get("stdin"):
            in_r, in_w = os.pipe()
        else:
            in_r, in_w = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), -1
        try:
            # no_new_privs is already set on the agent (inherited).
            pid = _spawn(argv, env, cwd, uid if uid != 0 else None, (in_r, out_w, err_w))
        except OSError as exc:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            self.ctrl({"op": "exit", "code": 127, "error": str(exc)}, stream)
            return
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.procs[stream] = pid
        if in_w >= 0:
            from _queue import SimpleQueue

            q: SimpleQueue[bytes | None] = SimpleQueue()
            self.stdin_q[stream] = q
            _thread.start_new_thread(self._feed, (in_w, q))
        done = [_thread.allocate_lock(), _thread.allocate_lock()]
        for lock in done:
            lock.acquire()
        _thread.start_new_thread(self._pump, (out_r, STDOUT, stream, done[0]))
        _thread.start_new_thread(self._pump, (err_r, STDERR, stream, done[1]))
        _thread.start_new_thread(self._reap, (pid, done, stream))
        self.ctrl({"op": "started", "pid": pid}, stream)

    def _feed(self, fd: int, q: SimpleQueue[bytes | None]) -> None:
        try:
            while (chunk := q.get()) is not None:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        except OSError:
            pass
        finally:
            os.close(fd)

    def _pump(self, fd: int, ftype: int, stream: int, done: _thread.LockType) -> None:
        try:
            while chunk := os.read(fd, MAX_PAYLOAD):
                self.send(encode_frame(ftype, stream, chunk))
            self.send(encode_frame(ftype, stream, b""))
        finally:
            os.close(fd)
            done.release()

    def _reap(self, pid: int, done: list[_thread.LockType], stream: int) -> None:
        _, status = os.waitpid(pid, 0)
        for lock in done:
            lock.acquire()
        self.procs.pop(stream, None)
        q = self.stdin_q.pop(stream, None)
        if q is not None:
            q.put(None)
        self.ctrl({"op": "exit", "code": os.waitstatus_to_exitcode(status)}, stream)

    def op_signal(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        pid = self.procs.get(stream)
        sig = int(msg["sig"])
        if pid is not None and 0 < sig <= SIGRTMAX:
            try:
                os.killpg(pid, sig)
            except OSError:
                pass

    # -- files: tar streams, extracted/created by the image's python in-guest
    def op_put(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        r, w = os.pipe()
        dest = str(msg["dest"])
        self.puts[stream] = (w, dest)
        _thread.start_new_thread(self._untar, (r, dest, stream))

    def put_chunk(self, stream: int, chunk: bytes) -> None:
        ent = self.puts.get(stream)
        if ent is None:
            return
        w = ent[0]
        if not chunk:
            os.close(w)
            self.puts.pop(stream, None)
            return
        try:
            os.write(w, chunk)
        except OSError:
            pass

    def _untar(self, r: int, dest: str, stream: int) -> None:
        # The workload owns where a copy lands (/workspace, /tmp) and may have planted
        # links there: extracting as root would write through them. So a child
        # extracts as the sandbox uid (it can write only where the workload could),
        # with the rules of tarfile's "data" filter (see UNTAR).
        import sys

        err = ""
        err_r, err_w = os.pipe()
        try:
            uid = self.uid if self.uid != 0 else None
            env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
            argv = [sys.executable or "python3", "-I", "-S", "-c", UNTAR, dest]
            pid = _spawn(argv, env, "/", uid, (r, err_w, err_w))
        except OSError as exc:
            pid, err = 0, f"cannot start the extraction: {exc}"
        finally:
            os.close(r)
            os.close(err_w)
        out = b""
        try:
            while chunk := os.read(err_r, 65536):
                out = (out + chunk)[-2000:]
        finally:
            os.close(err_r)
        if pid:
            _, status = os.waitpid(pid, 0)
            if status != 0:
                lines = out.decode(errors="replace").strip().splitlines()
                code = os.waitstatus_to_exitcode(status)
                err = lines[-1] if lines else f"the extraction exited with {code}"
        self.ctrl({"op": "put_ok", "error": err}, stream)

    def op_get(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        _thread.start_new_thread(self._tar, (str(msg["src"]), stream))

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
            arc = os.path.basename(src.rstrip("/")) or "."
            # A copy-on-write mount (a frozen environment) is not the workspace's:
            # its files never travel back with it.
            top = src.rstrip("/") + "/"
            skip = {arc + "/" + t[len(top) :] for t in self.cow_targets if t.startswith(top)}

            def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
                return None if ti.name in skip else ti

            with tarfile.open(fileobj=Sink(), mode="w|", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]
                tf.add(src, arcname=arc, recursive=True, filter=keep)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        self.send(encode_frame(FILE, stream, b""))
        self.ctrl({"op": "get_ok", "error": err}, stream)

    # -- gateway streams
    def start_gateway(self) -> None:
        if self.gateway_started:
            return
        import socket

        self.gateway_started = True
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", GATEWAY_PORT))
        srv.listen(64)
        _thread.start_new_thread(self._accept, (srv,))

    def start_sockets(self, names: list) -> None:  # type: ignore[type-arg]
        # Extra host sockets of the gateway dir (the egress proxy's ``egress.sock``):
        # each a unix socket at SOCKET_DIR/<name>, the sandbox uid's only, whose
        # connections ride the channel as gateway streams opened ``to`` that name.
        import socket

        for name in names:
            ok = isinstance(name, str) and 6 <= len(name) <= 32 and name.endswith(".sock")
            if not ok or not set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-."):
                raise ProtocolError(f"bad socket name {name!r:.40}")
            os.makedirs(SOCKET_DIR, 0o755, exist_ok=True)
            path = f"{SOCKET_DIR}/{name}"
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            os.chown(path, self.uid, self.uid)
            os.chmod(path, 0o600)
            srv.listen(64)
            _thread.start_new_thread(self._accept, (srv, name))

    def _accept(self, srv: socket.socket, to: str | None = None) -> None:
        from _queue import SimpleQueue

        while True:
            conn, _ = srv.accept()
            with self.lock:
                sid = self.next_gw
                self.next_gw += 2
            q: SimpleQueue[bytes | None] = SimpleQueue()
            self.gw[sid] = q
            credit = self.gw_credit[sid] = _Credit(GW_WINDOW)
            self.ctrl({"op": "gw_open"} if to is None else {"op": "gw_open", "to": to}, sid)
            down = _thread.allocate_lock()
            down.acquire()
            _thread.start_new_thread(self._gw_down, (conn, sid, q, down))
            _thread.start_new_thread(self._gw_up, (conn, sid, credit, down))

    def op_gw_credit(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        n = msg.get("n")
        if type(n) is not int or not 0 < n <= GW_WINDOW:
            raise ProtocolError(f"bad gateway credit {n!r}")
        credit = self.gw_credit.get(stream)
        if credit is not None:
            credit.add(n)

    def _gw_up(
        self, conn: socket.socket, sid: int, credit: _Credit, down: _thread.LockType
    ) -> None:
        # Read from the workload only what the host has room for: when the host
        # (the gateway) stops draining, the workload's own send blocks in here.
        try:
            while (room := credit.wait()) > 0:
                chunk = conn.recv(min(room, MAX_PAYLOAD))
                if not chunk:
                    break
                credit.spend(len(chunk))
                self.send(encode_frame(GW, sid, chunk))
        except OSError:
            pass
        self.send(encode_frame(GW, sid, b""))
        down.acquire()
        conn.close()
        self.gw_credit.pop(sid, None)

    def _gw_down(
        self, conn: socket.socket, sid: int, q: SimpleQueue[bytes | None], down: _thread.LockType
    ) -> None:
        import socket

        try:
            while (chunk := q.get()) is not None:
                conn.sendall(chunk)
        except OSError:
            pass
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.gw.pop(sid, None)
        down.release()


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
