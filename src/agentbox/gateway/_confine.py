"""Confining the gateway process once it has bound its socket.

The gateway parses every byte the sandbox sends, so it must hold as little as
possible while doing so. After its socket is bound and its token, key and
script are read, :func:`confine` makes the process:

- an unprivileged, dedicated uid/gid with no supplementary groups and no capability, not
  even in its bounding set (the caller's :func:`agentbox.linux.privdrop.drop_to`);
- ``no_new_privs`` (no setuid gain through exec);
- under a **seccomp filter** (libseccomp through ctypes). It is a deny-list, not
  an allow-list of syscalls: CPython, glibc, asyncio, threads and OpenSSL use a
  set of syscalls that changes across versions, and an allow-list that misses one
  kills the gateway mid-task. What is denied is the kernel surface and the escape
  primitives a parser has no use for: ``execve``/``execveat``, ``ptrace`` and
  ``process_vm_*``, every namespace and mount operation (``unshare``, ``setns``,
  ``mount``, ``pivot_root``, ``clone`` with a ``CLONE_NEW*`` flag, ``clone3``
  answers ENOSYS so glibc falls back to ``clone``), ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_*``, keyrings, kernel modules, ``kexec``,
  ``reboot``, ``swapon``, ``open_by_handle_at``, ``iopl``/``ioperm``, and sockets
  of any family but unix, IPv4, IPv6 and netlink (glibc's resolver may use
  netlink for the upstream's name). A denied syscall fails with EPERM; a syscall
  of another architecture (x32, i386) kills the process (libseccomp's default).
- bounded in memory (``RLIMIT_AS``) and in file size (``RLIMIT_FSIZE``, with
  SIGXFSZ ignored so an over-long write fails instead of killing the process).

Why libseccomp through ctypes and not ``python3-seccomp`` or a ``setpriv``/``bwrap``
wrapper: Debian's binding is built for the system Python, not our venv, and
``pyseccomp`` is an unmaintained ctypes shim of the same library; a wrapper
program would confine the gateway before it binds its socket and reads its
token (both need the starting identity). ``libseccomp2`` is already on every
host that runs podman (podman links it), so this adds no dependency; if it is
missing, :func:`confine` refuses to go on (fail closed).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import resource
import signal
import socket
from typing import Any

from agentbox.errors import GatewayError
from agentbox.linux.libc import libc as load_libc

_M_ARENA_MAX = -8
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
#: ``sizeof(struct sock_filter)``.
_BPF_INSN_SIZE = 8
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE, _SCMP_CMP_LT, _SCMP_CMP_EQ, _SCMP_CMP_GT = 1, 2, 4, 6
_SCMP_CMP_MASKED_EQ = 7
_CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}
#: Socket families the gateway may open: unix, IPv4, IPv6, netlink (the resolver).
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)

#: Syscalls that fail with EPERM inside the gateway.
DENIED_SYSCALLS = (
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "personality",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setgroups",
    "setfsuid",
    "setfsgid",
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


#: The libseccomp ABI this module calls (libseccomp2's soname).
LIBSECCOMP = "libseccomp.so.2"


def _libseccomp() -> Any:
    # By soname first, as the dynamic linker finds it: ctypes.util.find_library runs
    # `ldconfig -p` (a process, tens of ms) on every gateway's start, and a warm-pool
    # task's agent waits for that start.
    try:
        lib = ctypes.CDLL(LIBSECCOMP, use_errno=True)
    except OSError:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or LIBSECCOMP, use_errno=True)
        except OSError as exc:
            raise GatewayError(
                f"cannot confine the gateway: libseccomp not found ({exc}); install libseccomp2"
            ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.restype = ctypes.c_int
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


class SeccompFilter:
    """The gateway's filter, built (libseccomp rules) but not loaded: the template builds
    it once, each gateway forked from it loads it (:func:`install_seccomp`)."""

    def __init__(self) -> None:
        self._lib = _libseccomp()
        self._ctx = self._lib.seccomp_init(_SCMP_ACT_ALLOW)
        if not self._ctx:
            raise GatewayError("cannot confine the gateway: seccomp_init failed")
        try:
            self._add_rules()
        except BaseException:
            self._lib.seccomp_release(self._ctx)
            raise

    def _add_rules(self) -> None:
        lib, ctx = self._lib, self._ctx
        eperm = _errno_action(errno.EPERM)

        def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall on this architecture (iopl on arm64 …)
            arr = (_ArgCmp * max(1, len(cmps)))(*(_ArgCmp(*c) for c in cmps))
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise GatewayError(f"cannot confine the gateway: rule for {name} failed ({rc})")

        for name in DENIED_SYSCALLS:
            rule(eperm, name)
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc use clone.
        rule(_errno_action(errno.ENOSYS), "clone3")
        for flag in _CLONE_NEW.values():
            rule(eperm, "clone", (0, _SCMP_CMP_MASKED_EQ, flag, flag))
        # socket(): any family above the largest allowed, or a gap below it, is refused.
        top = max(ALLOWED_FAMILIES)
        rule(_errno_action(errno.EAFNOSUPPORT), "socket", (0, _SCMP_CMP_GT, top, 0))
        for fam in range(top):
            if fam not in ALLOWED_FAMILIES:
                rule(_errno_action(errno.EAFNOSUPPORT), "socket", (0, _SCMP_CMP_EQ, fam, 0))

    def load(self) -> None:
        """Load it into this process (all threads created later inherit it)."""
        rc = self._lib.seccomp_load(self._ctx)
        if rc < 0:
            raise GatewayError(f"cannot confine the gateway: seccomp_load failed ({rc})")

    def compile(self) -> bytes:
        """The BPF program :meth:`load` would load (``seccomp_export_bpf``): what
        :func:`load_program` loads without compiling it again."""
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            rc = self._lib.seccomp_export_bpf(self._ctx, w)
            os.close(w)
            w = -1
            if rc < 0:
                raise GatewayError(f"cannot confine the gateway: seccomp_export_bpf failed ({rc})")
            out = b""
            while chunk := os.read(r, 1 << 16):
                out += chunk
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if not out or len(out) % _BPF_INSN_SIZE or len(out) // _BPF_INSN_SIZE > 0xFFFF:
            raise GatewayError(f"cannot confine the gateway: a {len(out)}-byte BPF program")
        return out


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_program(program: bytes) -> None:
    """Load a compiled filter (:meth:`SeccompFilter.compile`) as ``seccomp_load`` does
    (``no_new_privs`` is already set by :func:`confine`; no flags: no thread sync, none
    needed before the gateway starts a thread)."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // _BPF_INSN_SIZE, ctypes.addressof(buf))
    libc = load_libc()
    rc = libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog),
                    ctypes.c_ulong(0), ctypes.c_ulong(0))  # fmt: skip
    if rc != 0:
        err = ctypes.get_errno()
        raise GatewayError(
            f"cannot confine the gateway: PR_SET_SECCOMP failed ({os.strerror(err)})"
        )


#: The filter :func:`prebuild` compiled (in the template), loaded by :func:`install_seccomp`.
_prebuilt: bytes | None = None


def prebuild() -> None:
    """Build and compile the filter now, for this process's forks to load (the gateway
    template): a fork then loads the program (one ``prctl``) instead of compiling the
    rules again (libseccomp's ``seccomp_load``: ~1 ms of every forked gateway's start)."""
    global _prebuilt
    _prebuilt = SeccompFilter().compile()


def install_seccomp() -> None:
    """Load the gateway's filter into this process (all threads created later inherit it):
    the program :func:`prebuild` compiled in the template this process was forked from,
    else the rules built and loaded now (the same filter)."""
    if _prebuilt is not None:
        load_program(_prebuilt)
    else:
        SeccompFilter().load()


def _prctl(option: int, arg: int) -> int:
    libc = load_libc()
    return int(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0))


def limit_resources(*, max_memory: int | None, max_file: int | None) -> None:
    """``RLIMIT_AS`` and ``RLIMIT_FSIZE`` (soft and hard), SIGXFSZ ignored.

    Under ``RLIMIT_AS`` glibc's one malloc arena per thread (64 MiB of address
    space each) would count against the limit: at most two arenas (``M_ARENA_MAX``).
    """
    if max_memory:
        with contextlib.suppress(OSError, AttributeError):
            load_libc().mallopt(_M_ARENA_MAX, 2)
        resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))
    if max_file:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file, max_file))


def confine() -> None:
    """``no_new_privs`` and the seccomp filter, for the rest of this process's life."""
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise GatewayError("cannot confine the gateway: PR_SET_NO_NEW_PRIVS failed")
    install_seccomp()
