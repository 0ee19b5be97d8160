#!/usr/bin/env python3
"""The escape suite's in-sandbox probe program (stdlib only, python3 >= 3.9).

One invocation runs every inside probe and prints one JSON object on stdout::

    {"probe_version": 1, "results": {"<probe id>": {"ok": true|false|null, "seen": "..."}}}

``ok`` is True when confinement held, False when the probe found a way out
(the escape suite calls that "fired"), None when the probe does not apply here
(e.g. the kernel has no ``/proc/kcore``); ``seen`` says what was observed.

The configuration (nonces, host ports, paths planted by the host; no secret)
arrives as JSON in ``ABX_PROBE_CONFIG`` or on stdin, never on the command line.
Each probe runs in a forked child with a hard time limit, so a probe that
blocks (a connect, a read of a device) is killed and reported, never hangs
the run. Nothing here writes to a
host-shared place except inside ``/tmp``; writable kernel files are only
*opened* for writing, never written, so running this on a weakened sandbox
(the positive controls) changes nothing on the host.

``--forkbomb N`` instead forks up to N sleeping children, reports how many it
got, and kills them: the host measures its own latency meanwhile.
``--exhaust inotify|mqueue|sigpending|aio`` spends one (per-user or host-wide)
kernel counter until the kernel refuses, holds it for ``--hold`` seconds, and
releases it: the host tries to spend one unit of the same counter as root meanwhile.

One file on purpose (it is sent into the sandbox as ``python3 -c`` or run from
``/opt/agentbox/probe.py``), grouped by area: identity, network, filesystem,
kernel surfaces, namespaces and devices, the token, limits, the runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

PROBE_VERSION = 1
PER_PROBE_TIMEOUT = 8.0

# Syscall numbers and flags (x86_64).
SYS_ADD_KEY = 248
SYS_KEYCTL = 250
SYS_REQUEST_KEY = 249
KEY_SPEC_SESSION_KEYRING = -3
KEY_SPEC_USER_KEYRING = -4
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
PTRACE_ATTACH = 16
PTRACE_DETACH = 17
TIOCSTI = 0x5412
PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "securityfs", "debugfs"}

Result = dict[str, Any]
CFG: dict[str, Any] = {}
_libc: Any = None


def libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def err(e: OSError | int) -> str:
    """A short name for an OSError or errno value."""
    n = e.errno if isinstance(e, OSError) else int(e)
    return errno.errorcode.get(n or 0, str(n))


def read(path: str, limit: int = 65536) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


def status_fields(path: str) -> dict[str, str]:
    out = {}
    for line in read(path).decode(errors="replace").splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def mountinfo() -> list[tuple[str, str, list[str], list[str], str]]:
    """[(target, fstype, mount options, super options, root)] of this mount namespace."""
    rows = []
    for line in read("/proc/self/mountinfo", 1 << 20).decode(errors="replace").splitlines():
        left, _, right = line.partition(" - ")
        f = left.split()
        r = right.split()
        if len(f) < 6 or len(r) < 3:
            continue
        target = f[4].replace("\\040", " ")
        rows.append((target, r[0], f[5].split(","), r[2].split(","), f[3]))
    return rows


WALK_CUT: list[str] = []


def walk(
    top: str, budget: float, skip: tuple[str, ...] = ("/proc", "/sys", "/dev")
) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (path, lstat) below ``top`` without following links; stops after ``budget`` seconds

    (and notes the cut in ``WALK_CUT``, so a probe can say its search was partial).
    """
    deadline = time.monotonic() + budget
    stack = [top]
    while stack:
        if time.monotonic() > deadline:
            WALK_CUT.append(top)
            return
        d = stack.pop()
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            p = os.path.join(d, n)
            if p in skip:
                continue
            try:
                st = os.lstat(p)
            except OSError:
                continue
            yield p, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(p)


def try_open_write(path: str) -> tuple[bool, str]:
    """Open ``path`` for writing and close it at once: never writes a byte."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        return False, err(e)
    os.close(fd)
    return True, "opened for writing"


def mount(
    src: str, target: str, fstype: str, flags: int = 0, data: str | None = None
) -> tuple[bool, str]:
    r = libc().mount(
        src.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    return r == 0, err(ctypes.get_errno()) if r != 0 else "mounted"


def in_child_ns(flags: int, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` in a forked child after unshare(flags); return (unshared, fn's result)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            r = libc().unshare(flags)
            res = {"unshare": r == 0, "errno": err(ctypes.get_errno()) if r else ""}
            if r == 0:
                res["result"] = fn()
            os.write(wfd, json.dumps(res).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    data = b""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        ready = readable(rfd, 0.2)
        if ready:
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            data += chunk
    os.close(rfd)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        res = json.loads(data.decode())
        if not isinstance(res, dict):
            raise ValueError("not an object")
        return res
    except ValueError:
        return {"unshare": False, "errno": "no answer"}


def readable(fd: int, timeout: float) -> bool:
    """poll(2), not select(2): gVisor's OCI seccomp refuses select here."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    return bool(p.poll(int(timeout * 1000)))


PROBES: dict[str, Callable[[], Result]] = {}


def probe(pid: str) -> Callable[[Callable[[], Result]], Callable[[], Result]]:
    def deco(fn: Callable[[], Result]) -> Callable[[], Result]:
        PROBES[pid] = fn
        return fn

    return deco


def result(ok: bool | None, seen: object) -> Result:
    return {"ok": ok, "seen": str(seen)[:400]}


# -- identity and privileges ------------------------------------------------


def _threads_field(field: str) -> dict[str, str]:
    vals = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            vals[tid] = status_fields(f"/proc/self/task/{tid}/status").get(field, "?")
        except OSError:
            continue
    return vals


@probe("caps.effective")
def p_capeff() -> Result:
    seen = {}
    for f in ("CapEff", "CapPrm", "CapAmb"):
        seen.update({f"{f}": v for v in _threads_field(f).values() if v != "?"})
    if "CapEff" not in seen:
        return result(False, "CapEff not reported")
    ok = all(int(v, 16) == 0 for v in seen.values())
    return result(ok, " ".join(f"{k}={v}" for k, v in seen.items()))


@probe("caps.bounding")
def p_capbnd() -> Result:
    vals = set(_threads_field("CapBnd").values())
    return result(all(int(v, 16) == 0 for v in vals), "CapBnd=" + ",".join(sorted(vals)))


@probe("privs.no_new_privs")
def p_nnp() -> Result:
    # gVisor's /proc does not show NoNewPrivs; prctl(PR_GET_NO_NEW_PRIVS) is answered everywhere.
    vals = set(_threads_field("NoNewPrivs").values()) - {"?"}
    pr = libc().prctl(39, 0, 0, 0, 0)
    ok = (not vals or vals == {"1"}) and pr == 1
    return result(ok, f"NoNewPrivs={','.join(sorted(vals)) or 'not shown'} prctl={pr}")


@probe("privs.seccomp")
def p_seccomp() -> Result:
    # gVisor shows Seccomp 0 in /proc but answers prctl(PR_GET_SECCOMP) for its own filter.
    vals = set(_threads_field("Seccomp").values()) - {"?"}
    pr = libc().prctl(21, 0, 0, 0, 0)
    e = err(ctypes.get_errno()) if pr < 0 else ""
    # -1: the filter itself refuses prctl, so one is on.
    ok = pr == 2 if gvisor() else vals == {"2"} and pr in (2, -1)
    return result(ok, f"Seccomp={','.join(sorted(vals)) or 'not shown'} prctl={pr}{e}")


def gvisor() -> bool:
    """A container whose runtime brings its own kernel (gVisor): the host says so
    (``own_kernel`` in the config, from its backend's traits); the kernel release agrees."""
    return CFG.get("own_kernel") is True


@probe("identity.uid")
def p_uid() -> Result:
    want = int(CFG.get("uid", 64000))
    ids = (os.getuid(), os.geteuid(), os.getgid(), os.getegid())
    groups = os.getgroups()
    ok = all(i == want for i in ids) and all(g == want for g in groups)
    return result(ok, f"uid/euid/gid/egid={ids} groups={groups}")


@probe("identity.uid_map")
def p_uid_map() -> Result:
    text = read("/proc/self/uid_map").decode().strip()
    rows = [line.split() for line in text.splitlines()]
    if gvisor():
        # gVisor's map is the Sentry's own kernel's; the host-side host.uid_map is the truth.
        return result(None, "gVisor: the map is the Sentry's (" + text + "); see host.uid_map")
    # A map whose outside start is 0 makes some sandbox uid the host's root.
    ok = bool(rows) and all(len(r) == 3 and int(r[1]) != 0 for r in rows)
    return result(ok, "uid_map: " + "; ".join(" ".join(r) for r in rows))


# -- network -------------------------------------------------------------------


@probe("net.only_lo")
def p_ifaces() -> Result:
    names = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    if not names:
        lines = read("/proc/net/dev").decode().splitlines()[2:]
        names = sorted(line.split(":")[0].strip() for line in lines)
    return result(names == ["lo"], "interfaces: " + ",".join(names))


def routable(
    addr: str, port: int, proto: int = socket.SOCK_STREAM, timeout: float = 1.5
) -> tuple[bool, str]:
    """(left the sandbox?, what happened) for one connect attempt."""
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, proto)
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        if proto == socket.SOCK_DGRAM:
            s.send(b"\0")
        return True, "connected"
    except TimeoutError:
        return True, "timed out (packets left: there is a route)"
    except OSError as e:
        # Unreachable or refused-by-policy means no route; anything else means a route exists.
        if e.errno in (
            errno.ENETUNREACH,
            errno.EHOSTUNREACH,
            errno.EACCES,
            errno.EPERM,
            errno.EADDRNOTAVAIL,
            errno.EAFNOSUPPORT,
        ):
            return False, err(e)
        return True, err(e)
    finally:
        s.close()


def nameservers() -> list[str]:
    out = []
    try:
        for line in read("/etc/resolv.conf").decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                out.append(parts[1].split("%")[0])
    except OSError:
        pass
    return out


@probe("net.dns")
def p_dns() -> Result:
    seen = []
    fired = False
    for ns in nameservers()[:3] or ["9.9.9.9"]:
        if ns.startswith("127."):
            continue
        left, what = routable(ns, 53, socket.SOCK_DGRAM)
        fired |= left
        seen.append(f"udp {ns}:53 {what}")
    socket.setdefaulttimeout(2)
    try:
        addrs = socket.getaddrinfo(CFG.get("dns_name", "example.com"), 443)
        fired = True
        seen.append(f"resolved to {addrs[0][4][0]}")
    except OSError as e:
        seen.append(f"getaddrinfo: {e}")
    return result(not fired, "; ".join(seen))


@probe("net.https")
def p_https() -> Result:
    seen = []
    fired = False
    for addr in CFG.get("internet_addrs", ["1.1.1.1", "8.8.8.8"]):
        left, what = routable(addr, 443)
        fired |= left
        seen.append(f"{addr}:443 {what}")
    return result(not fired, "; ".join(seen))


@probe("net.metadata")
def p_metadata() -> Result:
    seen = []
    fired = False
    for addr in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254"):
        left, what = routable(addr, 80)
        fired |= left
        seen.append(f"{addr}:80 {what}")
    return result(not fired, "; ".join(seen))


@probe("net.host_loopback")
def p_loopback() -> Result:
    ports = [int(p) for p in CFG.get("host_ports", [])]
    hosts = CFG.get("host_names", ["127.0.0.1", "localhost", "host.containers.internal"])
    reached = []
    tried = 0
    for h in hosts:
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(h, None, socket.AF_INET)}
        except OSError:
            continue
        for a in addrs:
            for port in ports:
                tried += 1
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(0.5)
                try:
                    s.connect((a, port))
                    reached.append(f"{h}({a}):{port}")
                except OSError:
                    pass
                finally:
                    s.close()
    if not ports:
        return result(None, "no host ports given")
    if reached:
        return result(False, "reached host listeners: " + ",".join(reached[:8]))
    return result(True, f"{tried} connects to {len(ports)} host ports on {hosts}: none answered")


@probe("net.host_abstract_socket")
def p_abstract() -> Result:
    name = CFG.get("abstract_name", "")
    if not name:
        return result(None, "no host abstract socket given")
    seen = []
    fired = False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect("\0" + name)
        fired = True
        seen.append(f"connected to @{name}")
    except OSError as e:
        seen.append(f"connect @{name}: {err(e)}")
    finally:
        s.close()
    try:
        listed = [
            line.split()[-1]
            for line in read("/proc/net/unix", 1 << 22).decode(errors="replace").splitlines()[1:]
            if line.split() and line.split()[-1].startswith("@")
        ]
    except OSError:
        listed = []
    host_like = [n for n in listed if name in n or "containerd" in n or "/run/" in n]
    if host_like:
        fired = True
    seen.append(f"{len(listed)} abstract sockets listed, host-like: {host_like[:5]}")
    return result(not fired, "; ".join(seen))


#: Address families (and netlink protocols) the sandbox must refuse: (name, family,
#: type, protocol). AF_VSOCK is not scoped by the network namespace (on a host that is
#: itself a VM, the hypervisor answers); the rest are kernel code an agent never needs.
#: The high-bit AF_VSOCK value (the kernel truncates the family to an int) catches a
#: deny-list filter that compares the full 64-bit register.
REFUSED_FAMILIES = (
    ("AF_VSOCK", 40, socket.SOCK_STREAM, 0),
    ("AF_VSOCK|1<<32", 40 | 1 << 32, socket.SOCK_STREAM, 0),
    ("AF_PACKET", 17, socket.SOCK_DGRAM, 0),
    ("AF_KEY", 15, socket.SOCK_RAW, 2),
    ("AF_ALG", 38, socket.SOCK_SEQPACKET, 0),
    ("AF_XDP", 44, socket.SOCK_RAW, 0),
    ("AF_TIPC", 30, socket.SOCK_RDM, 0),
    ("AF_RDS", 21, socket.SOCK_SEQPACKET, 0),
    ("AF_CAN", 29, socket.SOCK_RAW, 1),
    ("AF_BLUETOOTH", 31, socket.SOCK_RAW, 0),
    ("AF_NETLINK/audit", 16, socket.SOCK_RAW, 9),
    ("AF_NETLINK/uevent", 16, socket.SOCK_RAW, 15),
    ("AF_NETLINK/generic", 16, socket.SOCK_RAW, 16),
    ("AF_NETLINK/sock_diag", 16, socket.SOCK_RAW, 4),
)
SYS_SOCKET = 41


@probe("net.socket_families")
def p_socket_families() -> Result:
    libc().syscall.restype = ctypes.c_long
    opened, refused = [], []
    for name, fam, typ, proto in REFUSED_FAMILIES:
        fd = libc().syscall(SYS_SOCKET, ctypes.c_long(fam), typ, proto)
        if fd >= 0:
            os.close(fd)
            opened.append(name)
        else:
            refused.append(f"{name}:{err(ctypes.get_errno())}")
    # The families an agent does need must still work (else the filter is just broken).
    needed = []
    for fam, typ, proto in ((socket.AF_UNIX, socket.SOCK_STREAM, 0),
                            (socket.AF_INET, socket.SOCK_STREAM, 0),
                            (socket.AF_NETLINK, socket.SOCK_RAW, 0)):  # fmt: skip
        try:
            socket.socket(fam, typ, proto).close()
        except OSError as e:
            needed.append(f"{fam.name}:{err(e)}")
    seen = f"opened {opened}" if opened else "all refused"
    seen += f"; needed families failing: {needed}" if needed else "; unix/inet/netlink-route work"
    return result(not opened and not needed, seen + "; " + " ".join(refused))


# -- filesystem ------------------------------------------------------------------


def refuses_create(directory: str) -> tuple[bool, str]:
    path = os.path.join(directory, f".agentbox-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return True, f"{directory}: {err(e)}"
    os.close(fd)
    os.unlink(path)
    return False, f"{directory}: created a file"


@probe("fs.root_readonly")
def p_root_ro() -> Result:
    outs = [refuses_create(d) for d in ("/", "/etc", "/var", "/root", "/opt")]
    return result(all(o[0] for o in outs), "; ".join(o[1] for o in outs))


@probe("fs.usr_readonly")
def p_usr_ro() -> Result:
    outs = [refuses_create(d) for d in ("/usr", "/usr/bin", "/usr/lib", "/usr/local/bin")]
    return result(all(o[0] for o in outs), "; ".join(o[1] for o in outs))


def cannot_overwrite(path: str) -> tuple[bool | None, str]:
    """(True if every way of replacing ``path`` failed, what happened)."""
    if not os.path.exists(path):
        return None, f"{path} absent"
    seen = []
    ok = True
    w, what = try_open_write(path)
    if w:
        ok = False
    seen.append(f"open-w {what}")
    d = os.path.dirname(path)
    created, what = refuses_create(d)
    ok &= created
    seen.append(what)
    try:
        os.chmod(path, os.stat(path).st_mode)
        ok = False
        seen.append("chmod allowed")
    except OSError as e:
        seen.append(f"chmod {err(e)}")
    return ok, f"{path}: " + ", ".join(seen)


@probe("fs.guest_programs_immutable")
def p_opt() -> Result:
    base = CFG.get("guest_dir", "/opt/agentbox")
    if not os.path.isdir(base):
        return result(None, f"{base} absent")
    outs = [cannot_overwrite(os.path.join(base, n)) for n in sorted(os.listdir(base))[:20]]
    outs = [o for o in outs if o[0] is not None] or [cannot_overwrite(base + "/.")]
    return result(all(o[0] for o in outs), "; ".join(o[1] for o in outs)[:400])


@probe("fs.agent_binary_immutable")
def p_claude() -> Result:
    cands = [os.path.join(d, "claude") for d in os.environ.get("PATH", "").split(":") if d] + [
        "/usr/local/bin/claude",
        "/opt/claude/claude",
        "/usr/bin/claude",
    ]
    found = []
    for c in cands:
        if os.path.exists(c):
            real = os.path.realpath(c)
            if real not in found:
                found.append(real)
    if not found:
        return result(None, "no claude binary in this image")
    outs = [cannot_overwrite(p) for p in found]
    return result(all(o[0] for o in outs), "; ".join(o[1] for o in outs))


def sockets_below(roots: list[str], budget: float = 3.0) -> list[str]:
    out = []
    for r in roots:
        for p, st in walk(r, budget):
            if stat.S_ISSOCK(st.st_mode):
                out.append(p)
    return out


@probe("fs.no_container_socket")
def p_container_sock() -> Result:
    known = [
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/podman/podman.sock",
        "/var/run/podman/podman.sock",
        "/run/containerd/containerd.sock",
        "/var/run/crio/crio.sock",
        "/run/user/0/podman/podman.sock",
        "/var/run/cri-dockerd.sock",
    ]
    present = [k for k in known if os.path.exists(k)]
    env = [k for k in ("DOCKER_HOST", "CONTAINER_HOST") if k in os.environ]
    names = [
        s
        for s in sockets_below(["/run", "/var/run", "/tmp", "/home"])
        if re.search(r"(docker|podman|containerd|crio|libpod)", s)
    ]
    bad = present + env + names
    return result(not bad, "found: " + ",".join(bad) if bad else "no engine socket or env")


@probe("fs.launcher_socket_hidden")
def p_launcher_sock() -> Result:
    allowed = set(CFG.get("allowed_sockets", []))
    roots = sorted({m[0] for m in mountinfo() if m[1] not in PSEUDO_FS and m[0] != "/dev"})
    found = [s for s in sockets_below(roots, 4.0) if s not in allowed]
    named = CFG.get("launcher_socket")
    if named and os.path.exists(named):
        found.append(named)
    return result(
        not found,
        "unexpected sockets: " + ",".join(found[:8])
        if found
        else f"only allowed sockets ({sorted(allowed)}) under {len(roots)} mounts",
    )


@probe("image.no_package_manager")
def p_pkg() -> Result:
    tools = ["apt", "apt-get", "dpkg", "apk", "yum", "dnf", "microdnf", "rpm", "pacman", "zypper"]
    return _which(tools)


@probe("image.no_su_sudo")
def p_su() -> Result:
    return _which(["su", "sudo", "doas", "pkexec"])


def _which(tools: list[str]) -> Result:
    dirs = set(os.environ.get("PATH", "").split(":")) | {
        "/bin",
        "/sbin",
        "/usr/bin",
        "/usr/sbin",
        "/usr/local/bin",
        "/usr/local/sbin",
    }
    found = sorted(
        {
            os.path.join(d, t)
            for d in dirs
            for t in tools
            if d and os.path.lexists(os.path.join(d, t))
        }
    )
    return result(not found, "found: " + ",".join(found) if found else "none of " + ",".join(tools))


@probe("image.no_setuid")
def p_setuid() -> Result:
    found = []
    roots = sorted({m[0] for m in mountinfo() if m[1] not in PSEUDO_FS})
    roots = [r for r in roots if not r.startswith(("/proc", "/sys", "/dev"))]
    for p, st in walk("/", 6.0):
        if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            found.append(p)
    cut = f" (search cut at {WALK_CUT})" if WALK_CUT else ""
    return result(
        not found,
        f"setuid/setgid: {found[:10]}{cut}"
        if found
        else f"none under / ({len(roots)} mounts){cut}",
    )


@probe("fs.declared_mounts_only")
def p_mounts() -> Result:
    allowed = CFG.get("allowed_mounts")
    if allowed is None:
        return result(None, "no mount allow-list given")
    prefixes = tuple(CFG.get("allowed_mount_prefixes", ["/proc/", "/sys/", "/dev/"]))
    extra = sorted(
        {m[0] for m in mountinfo() if m[0] not in allowed and not m[0].startswith(prefixes)}
    )
    return result(
        not extra,
        "undeclared mounts: " + ",".join(extra[:10])
        if extra
        else "mount targets are exactly the declared set",
    )


def marker_hits(paths: list[str]) -> list[str]:
    nonce = CFG.get("marker_nonce", "")
    hits = []
    for p in paths:
        try:
            if nonce and nonce.encode() in read(p, 4096):
                hits.append(p)
        except OSError:
            pass
    return hits


@probe("fs.host_paths_invisible")
def p_host_paths() -> Result:
    marker = CFG.get("host_marker")
    if not marker:
        return result(None, "no host marker given")
    cands = [marker] + [m[0].rstrip("/") + marker for m in mountinfo() if m[0] != "/"]
    cands += [p for p in ("/etc/shadow",) if False]
    hits = marker_hits(cands)
    return result(
        not hits,
        f"host marker visible at {hits}"
        if hits
        else f"host marker invisible at {len(cands)} candidate paths",
    )


@probe("fs.symlink_resolves_inside")
def p_symlink() -> Result:
    links = CFG.get("workspace_links", [])
    if not links:
        return result(None, "no planted links")
    hits = marker_hits(links)
    return result(
        not hits,
        f"links reached the host marker: {hits}"
        if hits
        else f"{len(links)} host-planted links resolved inside (marker not reached)",
    )


@probe("fs.no_dotdot_escape")
def p_dotdot() -> Result:
    ws = CFG.get("workspace", "/workspace")
    marker = CFG.get("host_marker")
    parent_name = CFG.get("parent_marker_name")
    if not marker:
        return result(None, "no host marker given")
    cands = [ws + "/.." * k + marker for k in (1, 3, 8)]
    if parent_name:
        cands += [ws + "/../" + parent_name, ws + "/../../" + parent_name]
    hits = marker_hits(cands)
    return result(
        not hits, f"../ reached {hits}" if hits else f"{len(cands)} ../ paths stayed inside"
    )


@probe("fs.readonly_mount_refuses_writes")
def p_ro_mount() -> Result:
    target = CFG.get("ro_mount")
    if not target:
        return result(None, "no declared read-only mount")
    if not os.path.isdir(target):
        return result(False, f"{target} not mounted")
    ok, what = refuses_create(target)
    files = [os.path.join(target, n) for n in os.listdir(target)][:5]
    for f in files:
        w, ww = try_open_write(f)
        if w:
            ok = False
            what += f"; {f}: {ww}"
    return result(ok, what)


@probe("fs.readonly_remount_refused")
def p_remount() -> Result:
    seen = []
    ok = True
    opts = {m[0]: m[2] for m in mountinfo()}
    for target in [t for t in (CFG.get("ro_mount"), "/", "/usr") if t]:
        mopts = opts.get(target)
        if mopts is None:
            continue  # /usr is usually part of /
        if "rw" in mopts:
            # Already writable: that is the finding; never remount a writable mount (on a
            # weakened control or the host, that would change real mount flags).
            ok = False
            seen.append(f"{target} is mounted rw")
            continue
        done, what = mount("none", target, "", MS_REMOUNT | MS_BIND, None)
        if done:
            ok = False
            mount("none", target, "", MS_REMOUNT | MS_BIND | MS_RDONLY, None)  # put it back
        seen.append(f"remount {target} rw: {what}")
    return result(ok, "; ".join(seen))


@probe("fs.rw_mounts_nosuid_nodev")
def p_nosuid() -> Result:
    if gvisor():
        return result(
            None,
            "gVisor does not report mount flags; devices and setuid are the "
            "Sentry's own (host.no_new_privs, dev.mknod cover the threat)",
        )
    bad = []
    for target, fstype, opts, _sopts, _root in mountinfo():
        if "rw" not in opts or fstype in ("proc", "sysfs"):
            continue
        try:
            st = os.stat(target)
            if stat.S_ISCHR(st.st_mode):
                continue  # a single device node bound in (/dev/null …) must stay openable
        except OSError:
            continue
        needs_dev = target in ("/dev", "/dev/pts")
        missing = [o for o in ("nosuid",) + (() if needs_dev else ("nodev",)) if o not in opts]
        if missing:
            bad.append(f"{target}({fstype}) lacks {'/'.join(missing)}")
    return result(not bad, "; ".join(bad[:6]) if bad else "every rw mount is nosuid,nodev")


# -- kernel surfaces ------------------------------------------------------------


def host_lacks(path: str) -> bool:
    return path in CFG.get("host_missing", [])


def _kwrite(path: str) -> Result:
    if not os.path.exists(path):
        if host_lacks(path):
            return result(None, f"{path}: this kernel has none (checked on the host)")
        return result(True, f"{path} absent in the sandbox")
    w, what = try_open_write(path)
    return result(not w, f"{path}: {what}")


@probe("kernel.core_pattern_writable")
def p_core_pattern() -> Result:
    return _kwrite("/proc/sys/kernel/core_pattern")


@probe("kernel.modprobe_writable")
def p_modprobe() -> Result:
    return _kwrite("/proc/sys/kernel/modprobe")


@probe("kernel.uevent_helper_writable")
def p_uevent() -> Result:
    return _kwrite("/sys/kernel/uevent_helper")


@probe("kernel.sysrq_trigger_writable")
def p_sysrq() -> Result:
    return _kwrite("/proc/sysrq-trigger")


@probe("kernel.binfmt_misc_register")
def p_binfmt() -> Result:
    reg = "/proc/sys/fs/binfmt_misc/register"
    seen = []
    fired = False
    if os.path.exists(reg):
        w, what = try_open_write(reg)
        fired |= w
        seen.append(f"{reg}: {what}")
    d = f"/tmp/.agentbox-binfmt-{os.getpid()}"
    try:
        os.mkdir(d)
        done, what = mount("binfmt_misc", d, "binfmt_misc")
        seen.append(f"mount binfmt_misc: {what}")
        if done:
            w, what = try_open_write(d + "/register")
            fired |= w
            seen.append(f"register: {what}")
            libc().umount2(d.encode(), 2)
        os.rmdir(d)
    except OSError as e:
        seen.append(f"mkdir: {err(e)}")
    return result(not fired, "; ".join(seen))


@probe("kernel.kallsyms_addresses")
def p_kallsyms() -> Result:
    path = "/proc/kallsyms"
    if not os.path.exists(path):
        return result(True, f"{path} absent in the sandbox")
    try:
        data = read(path, 1 << 16).decode(errors="replace").splitlines()
    except OSError as e:
        return result(True, f"{path}: {err(e)}")
    addrs = [line.split()[0] for line in data if line.split()]
    nonzero = [a for a in addrs if a.strip("0")]
    if not addrs:
        return result(True, f"{path} empty")
    return result(not nonzero, f"{len(nonzero)}/{len(addrs)} symbol addresses non-zero")


def _readable(path: str) -> tuple[bool | None, str]:
    if not os.path.exists(path):
        if host_lacks(path):
            return None, f"{path}: this kernel has none (checked on the host)"
        return False, f"{path} absent in the sandbox"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return False, f"{path}: {err(e)}"
    try:
        data = os.read(fd, 4096)
    except OSError as e:
        return False, f"{path}: read {err(e)}"
    finally:
        os.close(fd)
    return bool(data), f"{path}: read {len(data)} bytes"


@probe("kernel.kcore_readable")
def p_kcore() -> Result:
    got, what = _readable("/proc/kcore")
    return result(None if got is None else not got, what)


@probe("kernel.kmsg_readable")
def p_kmsg() -> Result:
    outs = [_readable(p) for p in ("/dev/kmsg", "/proc/kmsg")]
    got = any(o[0] for o in outs)
    return result(not got, "; ".join(o[1] for o in outs))


@probe("kernel.sched_debug_readable")
def p_sched_debug() -> Result:
    outs = [_readable(p) for p in ("/proc/sched_debug", "/sys/kernel/debug/sched/debug")]
    seen = [o[1] for o in outs]
    got = any(o[0] for o in outs)
    d = f"/tmp/.agentbox-debugfs-{os.getpid()}"
    try:
        os.mkdir(d)
        done, what = mount("debugfs", d, "debugfs")
        seen.append(f"mount debugfs: {what}")
        if done:
            g, w = _readable(d + "/sched/debug")
            got |= bool(g) or os.path.isdir(d + "/sched")
            seen.append(w)
            libc().umount2(d.encode(), 2)
        os.rmdir(d)
    except OSError as e:
        seen.append(f"mkdir: {err(e)}")
    if all(o[0] is None for o in outs) and not got:
        return result(True, "; ".join(seen))
    return result(not got, "; ".join(seen))


@probe("kernel.keyring_syscalls")
def p_keyring() -> Result:
    # The session keyring is the sandbox's own (runc makes one per container); being able
    # to add keys or request them from the kernel is the surface the audit tools flag.
    r = libc().syscall(SYS_ADD_KEY, b"user", b"agentbox-probe", b"x", 1, KEY_SPEC_SESSION_KEYRING)
    if r >= 0:
        libc().syscall(SYS_KEYCTL, 3, r)  # KEYCTL_REVOKE: leave nothing behind
        libc().syscall(SYS_KEYCTL, 9, r, KEY_SPEC_SESSION_KEYRING)  # KEYCTL_UNLINK
        return result(False, f"add_key to the session keyring succeeded (key {r})")
    e = err(ctypes.get_errno())
    r2 = libc().syscall(SYS_REQUEST_KEY, b"user", b"agentbox-probe-none", None, 0)
    e2 = err(ctypes.get_errno())
    if r2 >= 0 or e2 not in ("ENOSYS", "EPERM", "EACCES"):
        return result(
            False, f"add_key {e}; request_key reached the kernel ({e2 if r2 < 0 else r2})"
        )
    return result(True, f"add_key {e}; request_key {e2}")


@probe("kernel.proc_keys_readable")
def p_proc_keys() -> Result:
    try:
        data = read("/proc/keys")
    except OSError as e:
        return result(True, f"/proc/keys: {err(e)}")
    try:
        users = read("/proc/key-users")
    except OSError:
        users = b""
    return result(not data, f"/proc/keys {len(data)} bytes, /proc/key-users {len(users)} bytes")


#: x86-64 machine code: ``mov eax, 20`` (getpid in the i386 table); ``int 0x80``; ``ret``.
_INT80_GETPID = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"


@probe("kernel.compat_syscalls")
def p_compat() -> Result:
    # The 32-bit syscall table is a second kernel entry point (and, for sockets, a
    # multiplexer seccomp cannot read): the filter admits the native ABI only.
    import mmap

    if os.uname().machine != "x86_64":
        return result(None, f"{os.uname().machine}: no i386 compat entry to try")
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(_INT80_GETPID)
    fn = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
    pid = os.fork()
    if pid == 0:
        got = fn()
        os._exit(0 if got == os.getpid() else 3)
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):
        return result(True, f"int 0x80 getpid: killed by signal {os.WTERMSIG(st)} (SIGSYS=31)")
    if os.WEXITSTATUS(st) == 0:
        return result(False, "int 0x80 getpid answered: the i386 syscall table is reachable")
    return result(True, "int 0x80 getpid: refused (no answer with this pid)")


@probe("limits.userns_caps")
def p_userns_caps() -> Result:
    """The per-user counters of this sandbox's user namespace are capped."""
    want = CFG.get("userns_caps") or {}
    if not isinstance(want, dict) or not want:
        return result(None, "no caps given")
    if gvisor():
        return result(None, "gVisor: inotify, mqueues and signals are the Sentry's own")
    over, seen = [], []
    for name, cap in sorted(want.items()):
        try:
            val = int(read(f"/proc/sys/user/{name}").decode().strip())
        except (OSError, ValueError):
            continue
        seen.append(f"{name}={val}")
        if val > int(cap):
            over.append(f"{name}={val}>{cap}")
    if not seen:
        return result(None, "no /proc/sys/user counters on this kernel")
    return result(not over, ("over the cap: " + " ".join(over)) if over else " ".join(seen))


# -- namespaces, mounts, devices ---------------------------------------------


@probe("ns.userns_creation")
def p_userns() -> Result:
    res = in_child_ns(CLONE_NEWUSER, lambda: "ok")
    return result(
        not res.get("unshare"),
        "unshare(CLONE_NEWUSER): " + ("succeeded" if res.get("unshare") else res.get("errno", "?")),
    )


def _cgroup_mount_and_release_agent() -> tuple[list[str], bool]:
    d = f"/tmp/.agentbox-cg-{os.getpid()}"
    out = []
    try:
        os.mkdir(d)
    except OSError as e:
        return [f"mkdir {err(e)}"], False
    fired = False
    # Existing hierarchies first: a new named one would be global state on a weak host.
    for fstype, data in (
        ("cgroup", "memory"),
        ("cgroup", "pids"),
        ("cgroup2", None),
        ("cgroup", "none,name=agentboxprobe"),
    ):
        done, what = mount("cgroup", d, fstype, 0, data)
        out.append(f"mount {fstype} {data or ''}: {what}")
        if done:
            fired = True
            _w, ww = try_open_write(d + "/release_agent")
            out.append(f"release_agent: {ww}")
            libc().umount2(d.encode(), 2)
            break
    os.rmdir(d)
    return out, fired


@probe("ns.cgroup_escape")
def p_cgroup() -> Result:
    seen = []
    fired = False
    for p, _st in walk("/sys/fs/cgroup", 2.0, skip=()):
        if p.endswith("/release_agent"):
            w, what = try_open_write(p)
            if w:
                fired = True
                seen.append(f"{p}: {what}")
    out, f2 = _cgroup_mount_and_release_agent()
    seen += out
    fired |= f2
    res = in_child_ns(
        CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP, lambda: _cgroup_mount_and_release_agent()
    )
    if res.get("unshare"):
        inner, f3 = res.get("result", ([], False))
        seen.append("after unshare -Umc: " + ", ".join(inner))
        fired |= bool(f3)
    else:
        seen.append(f"unshare -Umc: {res.get('errno')}")
    return result(not fired, "; ".join(seen))


@probe("ns.mount_syscall")
def p_mount() -> Result:
    d = f"/tmp/.agentbox-mnt-{os.getpid()}"
    os.mkdir(d)
    try:
        done, what = mount("tmpfs", d, "tmpfs")
        if done:
            libc().umount2(d.encode(), 2)
        done2, what2 = mount("/", d, "", MS_BIND)
        if done2:
            libc().umount2(d.encode(), 2)
    finally:
        os.rmdir(d)
    return result(not (done or done2), f"mount tmpfs: {what}; bind /: {what2}")


@probe("dev.mknod")
def p_mknod() -> Result:
    seen = []
    fired = False
    for name, mode, dev in (
        ("blk", stat.S_IFBLK, os.makedev(8, 0)),
        ("chr", stat.S_IFCHR, os.makedev(1, 1)),
    ):
        p = f"/tmp/.agentbox-{name}-{os.getpid()}"
        try:
            os.mknod(p, mode | 0o600, dev)
        except OSError as e:
            seen.append(f"mknod {name}: {err(e)}")
            continue
        try:
            if not gvisor():
                fired = True
                seen.append(f"mknod {name}: created")
                continue
            # gVisor lets anyone mknod in its own tmpfs; what matters is reaching a device.
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
                os.close(fd)
                fired = True
                seen.append(f"mknod {name}: created and opened (gVisor)")
            except OSError as e:
                seen.append(f"mknod {name}: created in gVisor's tmpfs, open {err(e)}")
        finally:
            os.unlink(p)
    return result(not fired, "; ".join(seen))


@probe("dev.host_disks_invisible")
def p_disks() -> Result:
    found = []
    for p, st in walk("/dev", 2.0, skip=()):
        if stat.S_ISBLK(st.st_mode):
            found.append(p)
    return result(not found, f"block devices: {found[:8]}" if found else "no block device in /dev")


@probe("fs.cgroup_readonly")
def p_cgroup_ro() -> Result:
    if gvisor():
        return result(None, "gVisor does not report mount flags; its cgroupfs is the Sentry's own")
    # The mount on top at each target counts (a read-only one over a rw one hides it).
    top = {t: (fstype, o) for t, fstype, o, _s, _r in mountinfo()}
    rows = [(t, o) for t, (fstype, o) in top.items() if fstype in ("cgroup", "cgroup2")]
    rw = [t for t, opts in rows if "ro" not in opts]
    if not rows:
        return result(True, "no cgroup hierarchy mounted")
    return result(not rw, f"mounted rw: {rw[:6]}" if rw else f"{len(rows)} hierarchies, all ro")


@probe("fs.sys_dev_block_masked")
def p_sys_dev_block() -> Result:
    try:
        names = os.listdir("/sys/dev/block")
    except OSError as exc:
        return result(True, f"/sys/dev/block unreadable ({exc.strerror})")
    return result(not names, f"lists {len(names)} host block devices: {sorted(names)[:6]}"
                  if names else "/sys/dev/block is empty (masked)")  # fmt: skip


#: The writable scratch directories that may hold programs (the agent builds and runs there).
EXEC_SCRATCH = ("/tmp", "/home/agent", "/workspace")


@probe("fs.dev_noexec")
def p_dev_noexec() -> Result:
    if gvisor():
        return result(None, "gVisor does not report mount flags; its /dev is the Sentry's own")
    bad = []
    top = {t: (fstype, o) for t, fstype, o, _s, _r in mountinfo()}
    for target, (fstype, opts) in top.items():
        if fstype != "tmpfs" or "rw" not in opts or "noexec" in opts:
            continue
        if target in EXEC_SCRATCH or target.startswith("/workspace/"):
            continue
        if not os.access(target, os.W_OK):
            continue  # not writable by us: nothing of ours can be put there to run
        bad.append(target)
    return result(not bad, f"writable tmpfs without noexec: {bad[:6]}" if bad
                  else "every tmpfs we can write but the scratch dirs is noexec")  # fmt: skip


@probe("dev.no_kvm")
def p_kvm() -> Result:
    present = os.path.exists("/dev/kvm")
    return result(not present, "/dev/kvm present" if present else "/dev/kvm absent")


@probe("tty.tiocsti")
def p_tiocsti() -> Result:
    seen = []
    fired = False
    fds = [0, 1, 2]
    try:
        fds.append(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
    except OSError as e:
        seen.append(f"/dev/tty: {err(e)}")
    for fd in fds:
        try:
            if not os.isatty(fd):
                continue
        except OSError:
            continue
        try:
            fcntl.ioctl(fd, TIOCSTI, b" ")
            fired = True
            seen.append(f"fd {fd}: TIOCSTI injected a byte")
        except OSError as e:
            seen.append(f"fd {fd}: tty, TIOCSTI {err(e)}")
    if not any("tty" in s for s in seen):
        seen.append("no terminal reachable")
    return result(not fired, "; ".join(seen))


def _fd_targets(pid: str) -> dict[int, str]:
    out = {}
    base = f"/proc/{pid}/fd"
    for n in os.listdir(base):
        try:
            out[int(n)] = os.readlink(f"{base}/{n}")
        except OSError:
            continue
    return out


@probe("fd.no_leaked_fds")
def p_fds() -> Result:
    allow = [
        re.compile(p)
        for p in CFG.get(
            "fd_allow",
            [
                r"^/dev/null$",
                r"^pipe:\[\d+\]$",
                r"^/dev/pts/\d+$",
                r"^anon_inode:\[?(eventpoll|signalfd|eventfd|timerfd|pidfd)\]?$",
            ],
        )
    ]
    bad = []
    checked = []
    for pid in ("1", "self"):
        try:
            targets = _fd_targets(pid)
        except OSError as e:
            bad.append(f"pid {pid}: fds unreadable ({err(e)})") if pid == "self" else None
            continue
        checked.append(f"pid {pid}: {len(targets)} fds")
        for fd, t in targets.items():
            if any(a.search(t) for a in allow):
                continue
            if fd <= 2 and gvisor() and re.match(r"^host:\[\d+\]$", t):
                continue  # gVisor shows the stdio pipes podman donated as host:[n]
            bad.append(f"pid {pid} fd {fd} -> {t}")
    return result(not bad, "; ".join(bad[:6]) if bad else ", ".join(checked))


def _decoys() -> list[int]:
    nonce = CFG.get("decoy_nonce", "")
    found: list[int] = []
    if not nonce:
        return found
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if nonce.encode() in read(f"/proc/{p}/cmdline"):
                found.append(int(p))
        except OSError:
            continue
    return found


@probe("proc.host_processes_invisible")
def p_pidns() -> Result:
    if not CFG.get("decoy_nonce"):
        return result(None, "no host decoy given")
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    found = _decoys()
    return result(
        not found,
        f"host decoy visible as pid {found}"
        if found
        else f"{len(pids)} processes visible, host decoy not among them",
    )


@probe("proc.ptrace_outside")
def p_ptrace() -> Result:
    if not CFG.get("decoy_nonce"):
        return result(None, "no host decoy given")
    found = _decoys()
    if not found:
        return result(True, "no process outside the sandbox is visible to attach to")
    seen = []
    fired = False
    for pid in found[:3]:
        r = libc().ptrace(PTRACE_ATTACH, pid, None, None)
        if r == 0:
            fired = True
            seen.append(f"PTRACE_ATTACH {pid}: attached")
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
            libc().ptrace(PTRACE_DETACH, pid, None, None)
        else:
            seen.append(f"PTRACE_ATTACH {pid}: {err(ctypes.get_errno())}")
    return result(not fired, "; ".join(seen))


# -- the agent's token -----------------------------------------------------------


def _token_re() -> re.Pattern[bytes]:
    return re.compile(CFG.get("token_regex", "x^").encode())


@probe("token.env")
def p_token_env() -> Result:
    rx = _token_re()
    hits = [k for k, v in os.environ.items() if rx.search(v.encode()) or rx.search(k.encode())]
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if rx.search(read(f"/proc/{p}/environ", 1 << 20)):
                    hits.append(f"/proc/{p}/environ")
            except OSError:
                continue
    return result(not hits, f"token found in {hits[:6]}" if hits else "no token in any environ")


@probe("token.cmdline")
def p_token_cmdline() -> Result:
    rx = _token_re()
    hits = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if rx.search(read(f"/proc/{p}/cmdline", 1 << 20)):
                    hits.append(f"/proc/{p}/cmdline")
            except OSError:
                continue
    return result(not hits, f"token found in {hits[:6]}" if hits else "no token in any cmdline")


@probe("token.files")
def p_token_files() -> Result:
    rx = _token_re()
    hits = []
    scanned = 0
    roots = [
        "/workspace",
        "/home",
        "/tmp",
        "/run",
        "/etc",
        "/opt",
        "/root",
        "/var",
        "/mnt",
        "/srv",
        "/media",
    ] + [
        m[0]
        for m in mountinfo()
        if m[1] not in PSEUDO_FS and not m[0].startswith(("/proc", "/sys", "/dev", "/usr"))
    ]
    deadline = time.monotonic() + 5.0
    seen_roots = set()
    for r in roots:
        if r in seen_roots or not os.path.isdir(r) or r == "/":
            continue
        seen_roots.add(r)
        for p, st in walk(r, max(0.1, deadline - time.monotonic())):
            if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
                continue
            scanned += 1
            try:
                if rx.search(read(p, 1 << 20)):
                    hits.append(p)
            except OSError:
                continue
    cut = f" (search cut at {WALK_CUT})" if WALK_CUT else ""
    return result(
        not hits, f"token in files {hits[:5]}" if hits else f"{scanned} files scanned{cut}"
    )


# -- limits -----------------------------------------------------------------------


def _cgroup_value(controller: str, name: str) -> str | None:
    bases = []
    try:
        for line in read("/proc/self/cgroup").decode().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                bases.append(f"/sys/fs/cgroup/{controller}{path}")
            elif ctrls == "":
                bases.append(f"/sys/fs/cgroup{path}")
    except (OSError, ValueError):
        pass
    for base in [*bases, f"/sys/fs/cgroup/{controller}", "/sys/fs/cgroup"]:
        p = f"{base}/{name}"
        if os.path.exists(p):
            return read(p).decode().strip()
    return None


@probe("limits.pids_visible")
def p_pids_limit() -> Result:
    v = _cgroup_value("pids", "pids.max")
    want = int(CFG.get("pids_max", 512))
    if v is None:
        return result(None, "no pids controller visible inside (checked from the host)")
    ok = v != "max" and int(v) <= want
    return result(ok, f"pids.max={v} (want <= {want})")


@probe("limits.disk")
def p_disk_limit() -> Result:
    """/workspace is a filesystem of at most the sandbox's disk limit, and it is full at it.

    Never writes past the limit on an unbounded workspace (a control's is the host's
    disk): the allocation is tried only once statvfs showed a bounded filesystem, and
    with fallocate(2) itself (no emulation by writing), which on the disk image costs
    the host no data blocks.
    """
    want = CFG.get("disk") or {}
    if not isinstance(want, dict) or not want.get("size"):
        return result(None, "no disk limit given")
    size, inodes = int(want["size"]), int(want.get("inodes") or 0)
    ws = str(CFG.get("workspace") or "/workspace")
    try:
        st = os.statvfs(ws)
    except OSError as e:
        return result(None, f"statvfs {ws}: {err(e)}")
    total, files = st.f_blocks * st.f_frsize, st.f_files
    seen = f"{ws}: {total >> 20} MiB, {files} inodes (limit {size >> 20} MiB, {inodes})"
    if total > size or (inodes and files > inodes):
        return result(False, f"{seen}: larger than the limit")
    ask = st.f_bavail * st.f_frsize + (1 << 20)
    path = f"{ws}/.agentbox-disk-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return result(None, f"{seen}; cannot create a file: {err(e)}")
    try:
        lc = libc()
        lc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        if lc.fallocate(fd, 0, 0, ask) == 0:
            return result(False, f"{seen}; allocated {ask >> 20} MiB, more than was free")
        code = ctypes.get_errno()
        if code in (errno.ENOSPC, errno.EDQUOT):
            return result(True, f"{seen}; {ask >> 20} MiB more: {errno.errorcode[code]}")
        why = errno.errorcode.get(code, str(code))
        return result(True, f"{seen}; fallocate: {why} (statvfs bounds it)")
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def forkbomb(n: int, hold: float) -> tuple[int, str, float]:
    """Fork up to ``n`` children that sleep; return (forked, first error)."""
    kids = []
    first = ""
    t0 = time.monotonic()
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError as e:
            first = err(e)
            break
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(hold)
            os._exit(0)
        kids.append(pid)
    took = time.monotonic() - t0
    time.sleep(min(hold, 1.0))
    for pid in kids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in kids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    return len(kids), first, took


# -- per-user kernel counters -----------------------------------------------------------
# ``--exhaust KIND`` spends one counter the kernel also charges to the owner of the
# sandbox's user namespace, holds it for ``--hold`` seconds while the host tries to
# spend one unit of it as root, then releases it. It never asks for more than
# EXHAUST_MAX units, and everything it took is released when it exits.

EXHAUST_MAX = 200_000


def exhaust_max() -> int:
    """How many units to ask for at most: the host passes root's limit plus a margin
    (enough to spend root's whole quota where nothing caps the sandbox, and no more:
    under gVisor nothing refuses, and the Sentry's memory is the sandbox's)."""
    try:
        return max(1, min(int(CFG.get("exhaust_max", EXHAUST_MAX)), EXHAUST_MAX))
    except (TypeError, ValueError):
        return EXHAUST_MAX


SYS_RT_TGSIGQUEUEINFO = 297


def _inotify_batch(out_fd: int, limit: int) -> None:
    """Child: open inotify instances until refused; write "count errno"; hold."""
    n, e = 0, 0
    while n < limit:
        if libc().inotify_init1(os.O_CLOEXEC) < 0:
            e = ctypes.get_errno()
            break
        n += 1
    os.write(out_fd, f"{n} {e}\n".encode())
    os.close(out_fd)
    signal.pause()


def exhaust_inotify(hold: float) -> dict[str, object]:
    """Open inotify instances until the kernel refuses, in as many children as the
    per-process fd limit needs (a child that stops well below it hit the quota)."""
    soft = fcntl_nofile()
    cap = exhaust_max()
    kids, total, first = [], 0, 0
    for _ in range(64):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _inotify_batch(w, cap - total)
            finally:
                os._exit(0)
        os.close(w)
        kids.append(pid)
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(r, 64)
            if not chunk:
                break
            line += chunk
        os.close(r)
        parts = line.split()
        n, e = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)
        total += n
        first = first or e
        if n < soft - 64 or total >= cap:
            break  # the quota, not this child's fd limit, stopped it
    time.sleep(hold)
    for pid in kids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in kids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    return {
        "kind": "inotify",
        "took": total,
        "errno": err(first) if first else "",
        "procs": len(kids),
    }


def fcntl_nofile() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class _MqAttr(ctypes.Structure):
    _fields_ = [
        ("mq_flags", ctypes.c_long),
        ("mq_maxmsg", ctypes.c_long),
        ("mq_msgsize", ctypes.c_long),
        ("mq_curmsgs", ctypes.c_long),
        ("pad", ctypes.c_long * 4),
    ]


def exhaust_mqueue(hold: float) -> dict[str, object]:
    """Create POSIX message queues until refused, big ones first and then ever smaller
    ones down to a single 64-byte message, so no byte of the quota is left; unlink after."""
    lib = libc()
    lib.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_MqAttr)]
    names: list[bytes] = []
    e = 0
    tag = f"/abx-probe-{os.getpid()}-"
    try:
        for maxmsg, size in ((10, 8192), (1, 8192), (1, 1024), (1, 64)):
            while len(names) < 4096:
                name = f"{tag}{len(names)}".encode()
                attr = _MqAttr(0, maxmsg, size, 0)
                flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
                if lib.mq_open(name, flags, 0o600, ctypes.byref(attr)) < 0:
                    e = ctypes.get_errno()
                    break
                names.append(name)
        # The host's watcher spends (and gives back) one small queue of the same quota
        # every few ms: a refusal may have come while it held one. Take what it gave back.
        for _ in range(10):
            time.sleep(0.02)
            name = f"{tag}{len(names)}".encode()
            if len(names) < 4096 and lib.mq_open(name, flags, 0o600, ctypes.byref(attr)) >= 0:
                names.append(name)
        time.sleep(hold)
    finally:
        for name in names:
            lib.mq_unlink(name)
    return {"kind": "mqueue", "took": len(names), "errno": err(e) if e else ""}


def exhaust_sigpending(hold: float) -> dict[str, object]:
    """Queue real-time signals to this (blocking) thread until refused; exit drops them."""
    sig = signal.SIGRTMIN + 2
    signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
    info = (ctypes.c_int * 32)()
    info[0], info[2] = sig, -1  # si_signo, si_code = SI_QUEUE
    lib = libc()
    lib.syscall.restype = ctypes.c_long
    n, e = 0, 0
    pid = os.getpid()
    cap = exhaust_max()
    while n < cap:
        if lib.syscall(SYS_RT_TGSIGQUEUEINFO, pid, pid, sig, info) != 0:
            e = ctypes.get_errno()
            break
        n += 1
    # Other processes of the same owner take their signals meanwhile: keep the quota full.
    end = time.monotonic() + hold
    while time.monotonic() < end:
        if n < cap and lib.syscall(SYS_RT_TGSIGQUEUEINFO, pid, pid, sig, info) == 0:
            n += 1
        time.sleep(0.0005)
    return {"kind": "sigpending", "took": n, "errno": err(e) if e else ""}


SYS_IO_SETUP = 206
SYS_IO_DESTROY = 207


def exhaust_aio(hold: float) -> dict[str, object]:
    """Reserve native AIO events (``fs.aio-max-nr``, one host-wide counter) until refused,
    in contexts of shrinking size; destroy them after."""
    lib = libc()
    lib.syscall.restype = ctypes.c_long
    ctxs: list[ctypes.c_ulong] = []
    took, e, n = 0, 0, 4096
    cap = exhaust_max()
    while took < cap:
        ctx = ctypes.c_ulong(0)
        size = min(n, cap - took)
        if lib.syscall(SYS_IO_SETUP, size, ctypes.byref(ctx)) != 0:
            e = ctypes.get_errno()
            if size > 1 and e == errno.EAGAIN:
                n = size // 2
                continue
            break
        ctxs.append(ctx)
        took += size
    time.sleep(hold)
    for ctx in ctxs:
        lib.syscall(SYS_IO_DESTROY, ctx)
    return {"kind": "aio", "took": took, "errno": err(e) if e else ""}


EXHAUST = {
    "inotify": exhaust_inotify,
    "mqueue": exhaust_mqueue,
    "sigpending": exhaust_sigpending,
    "aio": exhaust_aio,
}


# -- runner -------------------------------------------------------------------------


def run_one(name: str, fn: Callable[[], Result], timeout: float) -> Result:
    """Run probe ``fn`` in a forked child; kill it past ``timeout``."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(rfd)
            os.setpgid(0, 0)
            try:
                res = fn()
            except Exception as e:  # a probe that crashes reports it, never passes
                res = {
                    "ok": False,
                    "seen": f"probe crashed: {type(e).__name__}: {e}"[:400],
                    "error": True,
                }
            data = json.dumps(res).encode()
            while data:
                data = data[os.write(wfd, data) :]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    data = b""
    end = time.monotonic() + timeout
    timed_out = True
    while time.monotonic() < end:
        ready = readable(rfd, max(0.0, end - time.monotonic()))
        if not ready:
            continue
        chunk = os.read(rfd, 65536)
        if not chunk:
            timed_out = False
            break
        data += chunk
    os.close(rfd)
    for target in (-pid, pid):
        with contextlib.suppress(OSError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)
    if timed_out:
        return {"ok": False, "seen": f"probe timed out after {timeout:g}s", "error": True}
    try:
        res = json.loads(data.decode())
        if not isinstance(res, dict) or "ok" not in res:
            raise ValueError("bad shape")
        return res
    except ValueError:
        return {"ok": False, "seen": "probe gave no answer", "error": True}


def main(argv: list[str]) -> int:
    global CFG
    only = None
    fork_n = None
    exhaust = ""
    hold = 3.0
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--only":
            only = set(args.pop(0).split(","))
        elif a == "--forkbomb":
            fork_n = int(args.pop(0))
        elif a == "--hold":
            hold = float(args.pop(0))
        elif a == "--exhaust":
            exhaust = args.pop(0)
        elif a == "--list":
            print(json.dumps(sorted(PROBES)))
            return 0
    try:
        raw = os.environ.get("ABX_PROBE_CONFIG", "")
        if not raw and not sys.stdin.isatty():
            raw = sys.stdin.read()
        CFG = json.loads(raw) if raw.strip() else {}
    except ValueError:
        CFG = {}
    if not isinstance(CFG, dict):
        CFG = {}
    if exhaust:
        fn = EXHAUST.get(exhaust)
        res: dict[str, object] = fn(hold) if fn else {"kind": exhaust, "error": "unknown kind"}
        print(json.dumps({"probe_version": PROBE_VERSION, "exhaust": res}), flush=True)
        return 0
    if fork_n is not None:
        n, first, took = forkbomb(fork_n, hold)
        print(
            json.dumps(
                {
                    "probe_version": PROBE_VERSION,
                    "forkbomb": {
                        "forked": n,
                        "target": fork_n,
                        "error": first,
                        "seconds": round(took, 3),
                    },
                }
            )
        )
        return 0
    results = {}
    t0 = time.monotonic()
    for name in sorted(PROBES):
        if only is not None and name not in only:
            continue
        results[name] = run_one(name, PROBES[name], float(CFG.get("timeout", PER_PROBE_TIMEOUT)))
    out = {
        "probe_version": PROBE_VERSION,
        "seconds": round(time.monotonic() - t0, 3),
        "kernel": os.uname().release,
        "results": results,
    }
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
