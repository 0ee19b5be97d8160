"""Every probe of the escape suite, with what it tries, what it expects, and its control.

Inside probes are implemented in :mod:`agentbox.guest.probe` (ids match); host
probes in :mod:`agentbox.escape._hostcheck`. Each names the control that must
make it fire (:mod:`agentbox.escape._controls`):

* ``weak``     one deliberately weakened container: privileged, root in the host's
               user namespace, host network/pid/ipc/uts/cgroup namespaces, seccomp
               off, /proc unmasked, no limits, a host directory and fake engine and
               launcher sockets mounted, the token in its env and command line,
               a rw declared mount, a suid/dev tmpfs, /dev/kvm, fake apt/su/setuid files;
* ``tty``      the probe exec'd with a terminal (``exec -t``) on a normal sandbox;
* ``fd``       the probe exec'd with a host file descriptor passed in (``--preserve-fds``);
* ``stall``    the host latency meter run while the host itself is deliberately stalled;
* ``kernel``   the kernel comparison run against a runc container (which shares the kernel);
* ``shared``   two hardened sandboxes forced onto one host uid range.
"""

from __future__ import annotations

from agentbox.escape._model import ProbeSpec

_A = "seed A"
_B = "seed B"
_U = "audit tools"
_REVIEW = "security review"


def _in(pid: str, tried: str, expected: str, source: str, control: str = "weak") -> ProbeSpec:
    return ProbeSpec(pid, "inside", tried, expected, control, "all", source)


def _ct(pid: str, tried: str, expected: str, source: str) -> ProbeSpec:
    """An inside probe of a shared-kernel sandbox: in a microVM it is the guest's own

    kernel (root there is root only there), so it is n/a on VM backends, said so.
    """
    return ProbeSpec(pid, "inside", tried, expected, "weak", "container", source)


def _host(pid: str, tried: str, expected: str, source: str, control: str = "weak") -> ProbeSpec:
    return ProbeSpec(pid, "host", tried, expected, control, "all", source)


PROBES: tuple[ProbeSpec, ...] = (
    # identity and privileges (inside view)
    _in("caps.effective", "CapEff/CapPrm/CapAmb of every thread", "all 0", _A),
    _ct("caps.bounding", "CapBnd of every thread", "0 (nothing to regain)", _U),
    _in("privs.no_new_privs", "NoNewPrivs of every thread", "1", _A),
    _ct("privs.seccomp", "Seccomp mode of every thread", "2 (filter)", _A),
    _in("identity.uid", "uid/gid/groups inside", "64000 everywhere", _A),
    _ct("identity.uid_map", "/proc/self/uid_map", "no range maps to host uid 0", _A),
    # network
    _in("net.only_lo", "list network interfaces", "only lo", _A),
    _in("net.dns", "route to the nameservers; resolve a name", "no route, no answer", _A),
    _in("net.https", "TCP 443 to public addresses", "ENETUNREACH", _A),
    _in("net.metadata", "169.254.169.254 and friends", "unreachable", _U),
    _in(
        "net.host_loopback",
        "host listeners on 127.0.0.1, localhost, host.containers.internal, gateway addrs",
        "none reachable",
        _B,
    ),
    _in("net.host_abstract_socket", "connect to the host's abstract socket", "invisible", _U),
    _ct(
        "net.socket_families",
        "socket() for AF_VSOCK (also with high bits set), AF_PACKET, AF_KEY, AF_ALG, AF_XDP, "
        "AF_TIPC, AF_RDS, AF_CAN, AF_BLUETOOTH, netlink audit/uevent/generic/sock_diag",
        "all refused; unix, inet, netlink route still work",
        _REVIEW,
    ),
    # filesystem
    _in("fs.root_readonly", "create files in /, /etc, /var, /opt", "EROFS/EACCES", _B),
    _in("fs.usr_readonly", "create files in /usr", "EROFS/EACCES", _A),
    _in("fs.guest_programs_immutable", "overwrite /opt/agentbox/*", "refused", _B),
    _in("fs.agent_binary_immutable", "overwrite the claude binary", "refused", _B),
    _in("fs.no_container_socket", "docker/podman/containerd sockets, DOCKER_HOST", "none", _A),
    _in("fs.launcher_socket_hidden", "unix sockets under every mount", "only the gateway's", _B),
    _in("image.no_package_manager", "apt, dpkg, apk, dnf … on PATH", "none", _A),
    _in("image.no_su_sudo", "su, sudo, doas, pkexec", "none", _A),
    _in("image.no_setuid", "setuid/setgid files anywhere", "none", _A),
    _in("fs.declared_mounts_only", "mount targets vs the declared set", "exactly declared", _A),
    _in("fs.host_paths_invisible", "a host marker file at its path and under mounts", "absent", _B),
    _in("fs.symlink_resolves_inside", "host-planted links in /workspace", "resolve inside", _B),
    _in("fs.no_dotdot_escape", "/workspace/../… to host paths", "stays inside", _B),
    _in("fs.readonly_mount_refuses_writes", "write into a read-only declared mount", "EROFS", _B),
    _in("fs.readonly_remount_refused", "mount -o remount,rw the ro mounts and /", "EPERM", _B),
    _ct("fs.rw_mounts_nosuid_nodev", "options of every rw mount", "nosuid,nodev", _U),
    # kernel surfaces
    _in("kernel.core_pattern_writable", "open core_pattern for writing", "refused", _U),
    _in("kernel.modprobe_writable", "open /proc/sys/kernel/modprobe for writing", "refused", _U),
    _in(
        "kernel.uevent_helper_writable", "open /sys/kernel/uevent_helper for writing", "refused", _U
    ),
    _in("kernel.sysrq_trigger_writable", "open /proc/sysrq-trigger for writing", "refused", _U),
    _in("kernel.binfmt_misc_register", "binfmt_misc register, or mount it", "refused", _U),
    _in("kernel.kallsyms_addresses", "read /proc/kallsyms", "addresses hidden", _U),
    _in("kernel.kcore_readable", "read /proc/kcore", "refused or empty", _U),
    _in("kernel.kmsg_readable", "read /dev/kmsg, /proc/kmsg", "refused", _U),
    _in("kernel.sched_debug_readable", "sched_debug, or debugfs mountable", "refused", _U),
    _ct("kernel.keyring_syscalls", "add_key, request_key", "blocked", _U),
    _ct("kernel.proc_keys_readable", "read /proc/keys", "masked (empty)", _U),
    _ct("kernel.compat_syscalls", "getpid through the i386 entry (int 0x80)", "refused", _REVIEW),
    # namespaces, devices, processes
    _in("ns.userns_creation", "unshare(CLONE_NEWUSER)", "refused", _U),
    _in(
        "ns.cgroup_escape",
        "release_agent writable; mount cgroup, also after unshare -Umc",
        "refused",
        _U,
    ),
    _in("ns.mount_syscall", "mount tmpfs, bind /", "EPERM", _U),
    _in("dev.mknod", "mknod a block and a char device", "EPERM", _U),
    _ct("dev.host_disks_invisible", "block devices in /dev", "none", _U),
    _in("dev.no_kvm", "/dev/kvm", "absent", _B),
    _ct("fs.cgroup_readonly", "mount options of every cgroup hierarchy", "all ro", _REVIEW),
    _ct("fs.sys_dev_block_masked", "list /sys/dev/block", "masked (empty)", _REVIEW),
    _ct("fs.dev_noexec", "options of every tmpfs it can write but /tmp, home", "noexec", _REVIEW),
    _in("tty.tiocsti", "TIOCSTI into every reachable terminal", "refused or none", _U, "tty"),
    _in("fd.no_leaked_fds", "fds of PID 1 and the agent vs an allow-list", "none leaked", _U, "fd"),
    _in("proc.host_processes_invisible", "find a host decoy process", "invisible", _U),
    _in("proc.ptrace_outside", "PTRACE_ATTACH a process outside", "impossible", _U),
    _in("token.env", "the planted token in env and /proc/*/environ", "absent", _B),
    _in("token.cmdline", "the planted token in /proc/*/cmdline", "absent", _B),
    _in("token.files", "the planted token in files", "absent", _B),
    _in("limits.pids_visible", "pids.max of its own cgroup", "<= the declared limit", _B),
    _in(
        "limits.disk",
        "statvfs /workspace, then fallocate 1 MiB more than is free",
        "<= the disk limit; ENOSPC",
        _REVIEW,
    ),
    _ct(
        "limits.userns_caps",
        "/proc/sys/user/max_* (inotify, fanotify, namespaces) of its user namespace",
        "<= agentbox's caps",
        _REVIEW,
    ),
    # host-side posture, read from the live sandbox's processes (every thread)
    _host("host.caps_effective", "CapEff/CapPrm of every sandbox thread", "0", _B),
    _host("host.caps_bounding", "CapBnd of every sandbox thread", "0", _U),
    _host("host.no_new_privs", "NoNewPrivs of every sandbox thread", "1", _B),
    _host("host.seccomp", "Seccomp of every sandbox thread", "2", _B),
    _host("host.uid", "host uid of every sandbox thread", "the mapped uid, not 0/yours", _A),
    _host("host.uid_map", "uid_map of the sandbox", "sandbox uid -> mapped host uid", _A),
    _host(
        "host.uid_own_range",
        "host uids of every thread vs a neighbour sandbox's (started beside it, own slot)",
        "none shared: a range of its own",
        _REVIEW,
        "shared",
    ),
    _host("host.ns_net", "network namespace vs the host's", "its own", _B),
    _host("host.ns_pid", "pid namespace vs the host's", "its own", _U),
    _host("host.ns_ipc", "ipc namespace vs the host's", "its own", _A),
    _host("host.ns_uts", "uts namespace vs the host's", "its own", _U),
    _host("host.ns_user", "user namespace vs the host's", "its own", _U),
    _host("host.ns_cgroup", "cgroup namespace vs the host's", "its own", _U),
    _host("host.pids_limit", "pids.max of the sandbox cgroup", "<= declared", _B),
    _host("host.memory_limit", "memory limit of the sandbox cgroup", "<= declared", _B),
    _host("host.forkbomb_contained", "fork bomb inside", "stops at the pids limit", _B),
    _host(
        "host.forkbomb_latency",
        "host sleep-loop latency during the fork bomb",
        "stays low",
        _B,
        "stall",
    ),
    _host("host.own_kernel", "kernel release/boot id inside vs host", "differs", _B, "kernel"),
    # per-user kernel counters charged to the namespace owner (root): the host must keep its own
    _host(
        "host.quota_inotify",
        "sandbox opens inotify instances until refused; root opens one meanwhile",
        "root never refused",
        _REVIEW,
    ),
    _host(
        "host.quota_mqueue",
        "sandbox creates POSIX message queues until refused; root creates one meanwhile",
        "root never refused",
        _REVIEW,
    ),
    _host(
        "host.quota_sigpending",
        "sandbox queues real-time signals until refused; root queues one meanwhile",
        "root never refused",
        _REVIEW,
    ),
    _host(
        "host.quota_aio",
        "sandbox reserves native AIO events (fs.aio-max-nr, host-wide) until refused; "
        "root sets up one context meanwhile",
        "root never refused",
        _REVIEW,
    ),
    # the gateway: the host spawns one as run_task does and reads every thread from /proc
    _host(
        "gateway.uid", "uids of every gateway thread", "only its dedicated uid, never 0", _REVIEW
    ),
    _host("gateway.caps", "CapEff/CapPrm/CapBnd of every gateway thread", "all 0", _REVIEW),
    _host("gateway.no_new_privs", "NoNewPrivs of every gateway thread", "1", _REVIEW),
    _host("gateway.seccomp", "Seccomp mode of every gateway thread", "2 (filter)", _REVIEW),
    _host("gateway.memory_limit", "the gateway's RLIMIT_AS", "finite", _REVIEW),
    # the egress proxy: the host starts a real one, the sandbox asks it for inner targets
    _host(
        "host.egress_proxy_inner",
        "through a real egress proxy, from inside: CONNECT/GET to localhost, a metadata name, "
        "and loopback, metadata and private address literals",
        "each refused for its address (403 ip-literal, address:*)",
        _REVIEW,
    ),
    # a request rule's injected header: only its own host's requests carry it
    _host(
        "host.egress_injection_scope",
        "through a real proxy whose rule injects a header for one host: a redirect to another "
        "host, the other name in SNI, Host and an absolute URL, Upgrade and HTTP/2",
        "the header reaches only the rule host's own requests; the mismatches never reach "
        "the upstream",
        _REVIEW,
    ),
    # [git] fetch's rules: the remote's upload-pack with the credential, never a push
    _host(
        "host.egress_push_refused",
        "through a real proxy holding a task's [git] fetch rules: a fetch, then a push by "
        "every route (receive-pack refs and POST, two service queries, case, %2d, dots, //)",
        "the fetch arrives with the credential; no receive-pack request reaches the remote",
        _REVIEW,
    ),
    # a brokered secret: planted in a store, held by a real proxy whose rule injects it
    _host(
        "host.secret_not_in_sandbox",
        "a secret a rule injects, held by a real egress proxy: searched for from inside in "
        "the proxy's answers, every process's environ and cmdline, and the mounted files",
        "found nowhere",
        _REVIEW,
    ),
)

_BY_ID = {p.id: p for p in PROBES}


def by_id(pid: str) -> ProbeSpec:
    """The spec of probe ``pid`` (KeyError if unknown)."""
    return _BY_ID[pid]
