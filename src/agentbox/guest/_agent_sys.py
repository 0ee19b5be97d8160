"""The guest agent's system side: constants, helpers and the channel's io base.

Part of the guest agent (see :mod:`agentbox.guest.agent` for the protocol and
why it imports only builtin C modules at start-up): kernel facts, finding the
port and labelled disks, ``mount(2)`` through ctypes, no_new_privs, the RNG
reseed, the fork+exec of commands, per-stream gateway credit, and
:class:`Channel` (the state every part of the agent shares and its writes).
"""

from __future__ import annotations

# ruff: noqa: SIM105 - try/except/pass instead of contextlib.suppress: no contextlib import
import _thread
import fcntl
import os
import struct
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only; never imported in the guest
    from _queue import SimpleQueue
    from typing import Any

if __package__:
    from .wire import (
        MAX_PAYLOAD,
        encode_ctrl,
        encode_frame,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from wire import (  # type: ignore[import-not-found,no-redef]
        MAX_PAYLOAD,
        encode_ctrl,
        encode_frame,
    )

PORT_NAME = "agentbox.0"
GATEWAY_PORT = 8080
MOUNT_LABEL_PREFIX = "agentbox-m"
WORKSPACE = "/workspace"
#: Where the extra host sockets appear (the container layout's gateway dir).
SOCKET_DIR = "/run/agentbox/gw"
#: The copy-on-write mounts' lower disks' mount points (root's, 0700).
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


#: The agent CLI a task runs, started once by a snapshot template (see _preload).
_PRELOAD_CLI = "claude"
_PRELOAD_PATH = "/usr/local/bin:/usr/bin:/bin"
#: The sandbox's uid (the agent's default, ``Agent.uid``): the preload runs as it.
_PRELOAD_UID = 64000


def _preload() -> None:
    # A snapshot template imports now what a session may need later, so that
    # restored guests never pay for it (see the note at the imports).
    import ctypes  # noqa: F401
    import resource  # noqa: F401
    import shutil
    import socket  # noqa: F401
    import subprocess
    import tarfile  # noqa: F401
    from _queue import SimpleQueue  # noqa: F401

    # The agent CLI starts once (``--version``, no network, a scratch HOME removed
    # after), so the pages of its binary it reads at start (~75 MiB of Claude Code's
    # 400 MB) are in the template's page cache: every restored guest shares them from
    # the snapshot's RAM instead of reading them from the root disk into its own.
    exe = shutil.which(_PRELOAD_CLI, path=_PRELOAD_PATH)
    if exe is None:
        return
    home = "/tmp/.agentbox-preload"
    try:
        os.mkdir(home, 0o700)
        os.chown(home, _PRELOAD_UID, _PRELOAD_UID)
        # As an unprivileged uid: the image's program never runs as the guest's root.
        subprocess.run([exe, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=home, timeout=60, check=False,
                       env={"HOME": home, "PATH": _PRELOAD_PATH}, user=_PRELOAD_UID,
                       group=_PRELOAD_UID, extra_groups=[])  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pass
    shutil.rmtree(home, ignore_errors=True)


def _reseed(seed: bytes, now: float | None) -> None:
    # RNDADDENTROPY credits the entropy; after a snapshot restore every clone
    # starts from the same RNG state, so this is what makes them diverge.
    # RNDRESEEDCRNG then makes the kernel's CRNG take it now, not at its next scheduled
    # reseed (up to a minute later), so the first random bytes of clones differ too.
    rnd_add_entropy, rnd_reseed_crng = 0x40085203, 0x5207
    try:
        with open("/dev/urandom", "wb") as f:
            fcntl.ioctl(f, rnd_add_entropy, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            fcntl.ioctl(f, rnd_reseed_crng)
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


class Channel:
    """The state every part of the agent shares, and its writes to the host."""

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
