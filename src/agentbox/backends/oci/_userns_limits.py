"""Per-sandbox caps on the kernel counters charged to the owner of its user namespace.

The kernel charges some per-user counters at every level of the user-namespace
tree (``inc_ucount``/``inc_rlimit_ucounts``), up to the user that owns the
top-level namespace. podman, running as root, makes each sandbox's user namespace
owned by root, so what a sandbox spends is also spent from *root's* host-wide
quota. Measured here on runc: a sandbox that called
``inotify_init1`` until it failed got all 128 of ``fs.inotify.max_user_instances``,
and root on the host got EMFILE at once; the same held for POSIX message queues
(9 queues spent root's 800 KiB ``RLIMIT_MSGQUEUE``) and queued real-time signals
(96,357 spent root's ``RLIMIT_SIGPENDING``).

A user namespace owned by an unprivileged user would make the chain end at that
user instead of root. podman 4.3 cannot do that here: ``--userns ns:PATH`` (join a
namespace we made as another owner) is refused together with ``--uidmap``, and
without it podman maps only ``0:0:1`` and the sandbox uid is not mapped (tried).
So each counter is bounded instead, per sandbox, and the host's limits are sized
above tasks x cap:

* ``/proc/sys/user/max_*`` are per user namespace, and the kernel checks a
  namespace's own maximum before it charges the level above. An OCI ``prestart``
  hook (:data:`HOOK_SCRIPT`, run by runc as root after the namespaces exist and
  before the workload starts) writes :data:`SANDBOX_CAPS` into the sandbox's
  namespace. The hook fails closed: if it cannot write, runc does not start the
  container.
* rlimit-backed counters (``RLIMIT_SIGPENDING``, ``RLIMIT_MSGQUEUE``) are checked
  against the process's own rlimit at the sandbox's level; podman's ``--ulimit``
  sets them (:data:`SANDBOX_RLIMITS`).
* the host limits for root (:data:`HOST_SYSCTLS`) leave room for
  :data:`HOST_SANDBOXES` sandboxes at their caps plus root's own use; they are
  set by ``scripts/setup.sh`` and checked by ``agentbox doctor``.

Under gVisor (runsc) a workload's inotify, message queues and signals are the
Sentry's own (measured: 4,093 instances inside, the host untouched); the hook
leaves gVisor's sandbox alone. docs/explanation/threat-model.md has
the audit of every counter.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from agentbox.errors import UnsupportedError

#: Written into each sandbox's own user namespace (``/proc/sys/user/NAME``).
#: inotify: node's and Claude Code's watchers need a handful of instances and a watch
#: per watched directory; each watch is charged to the sandbox's memory cgroup.
#: Namespaces and fanotify: the workload cannot make any (seccomp refuses
#: CLONE_NEWUSER, it holds no CAP_SYS_ADMIN, fanotify_init needs it); 0 says so twice.
SANDBOX_CAPS: dict[str, int] = {
    "max_inotify_instances": 64,
    "max_inotify_watches": 32768,
    "max_fanotify_groups": 0,
    "max_fanotify_marks": 0,
    "max_user_namespaces": 0,
    "max_mnt_namespaces": 0,
    "max_pid_namespaces": 0,
    "max_net_namespaces": 0,
    "max_ipc_namespaces": 0,
    "max_uts_namespaces": 0,
    "max_cgroup_namespaces": 0,
    "max_time_namespaces": 0,
}

#: ``podman run --ulimit`` values (soft = hard). 0 message-queue bytes: no agent tool
#: uses POSIX message queues. 1024 queued signals: far above what a shell or node needs.
SANDBOX_RLIMITS: dict[str, int] = {"sigpending": 1024, "msgqueue": 0}

#: How many sandboxes at their caps the host's limits for root must leave room for.
HOST_SANDBOXES = 128
#: What root itself keeps (the kernel's defaults for one user).
_ROOT_OWN = {"max_user_instances": 128, "max_user_watches": 65536}

#: Host sysctls (``fs.inotify.*``: root's quota, the top level of every sandbox's chain).
HOST_SYSCTLS: dict[str, int] = {
    "fs.inotify.max_user_instances": SANDBOX_CAPS["max_inotify_instances"] * HOST_SANDBOXES
    + _ROOT_OWN["max_user_instances"],
    "fs.inotify.max_user_watches": SANDBOX_CAPS["max_inotify_watches"] * HOST_SANDBOXES
    + _ROOT_OWN["max_user_watches"],
}

_HOOK_NAME = "agentbox-userns-limits.json"

#: The OCI ``prestart`` hook (POSIX sh, shell builtins only up to ``nsenter``: 3 processes,
#: where one per step (``head``, ``tr``, ``sed``, ``readlink``, ``grep``, a ``cat`` per
#: value: 20) cost 0.10-0.30 s of every sandbox's start on a busy 2-core host; Python took
#: ~150 ms). runc runs it as root on the host with the OCI state (JSON with ``pid``)
#: on stdin and ``NAME=VALUE`` arguments. It enters the sandbox's user namespace as
#: that namespace's root (``nsenter -S 0 -G 0``: a process that only joined it keeps no
#: capability across ``exec``), writes each ``/proc/sys/user/NAME`` (those files are
#: per user namespace) and reads them back (one ``cat``: a sysctl file reads empty past
#: offset 0, so the shell's byte-wise ``read`` cannot). Any failure exits non-zero, and
#: runc then refuses to start the container. A process in the hook's own user namespace
#: is left alone (writing there would change the host's limits), and so is a namespace
#: without a uid 0 (gVisor's sandbox: the workload's counters are the Sentry's own).
HOOK_SCRIPT = r"""#!/bin/sh
# agentbox: cap the per-user kernel counters of a sandbox's user namespace.
# Written by agentbox.backends.oci._userns_limits; do not edit.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
die() { echo "agentbox userns-limits hook: $*" >&2; exit 1; }
for arg in "$@"; do
  name=${arg%%=*} value=${arg#*=}
  case "$name" in max_*) ;; *) die "bad limit argument '$arg'" ;; esac
  case "$name" in *[!a-z_]*) die "bad limit argument '$arg'" ;; esac
  case "$value" in '' | *[!0-9]*) die "bad limit argument '$arg'" ;; esac
  [ "$arg" = "$name=$value" ] || die "bad limit argument '$arg'"
done
# Builtins only from here to nsenter: every process costs each sandbox's start.
state=
while IFS= read -r line || [ -n "$line" ]; do
  state=$state$line
  [ ${#state} -le 1048576 ] || die "OCI state too long"
done
pid=
case "$state" in
  *'"pid"'*)
    rest=${state##*\"pid\"}
    rest=${rest#"${rest%%[!:[:space:]]*}"}
    pid=${rest%%[!0-9]*} ;;
esac
case "$pid" in '' | 0 | 1 | *[!0-9]*) die "OCI state has no usable pid: '$pid'" ;; esac
[ -e "/proc/$pid/ns/user" ] || die "no user namespace for pid $pid"
! [ /proc/self/ns/user -ef "/proc/$pid/ns/user" ] || exit 0
# No uid 0 in it: not a runc container's namespace but gVisor's sandbox (its Sentry runs
# as nobody there, and the workload's counters are the Sentry's own).
root=
while read -r inside outside count; do
  [ "$inside" != 0 ] || root=1
done < "/proc/$pid/uid_map"
[ -n "$root" ] || exit 0
# fd 9: the hook's own user namespace, for the check that nsenter did leave it.
exec 9< /proc/self/ns/user
exec nsenter --setuid 0 --setgid 0 --user="/proc/$pid/ns/user" -- /bin/sh -eu -c '
! [ /proc/self/ns/user -ef /proc/self/fd/9 ] || { echo "in the host namespace" >&2; exit 1; }
exec 9<&-
nl="
"
files= want=
for arg in "$@"; do
  f=/proc/sys/user/${arg%%=*} v=${arg#*=}
  [ -e "$f" ] || continue
  printf "%s\n" "$v" > "$f"
  files="$files $f" want=$want$v$nl
done
[ -z "$files" ] || got=$(cat $files)$nl
[ -z "$files" ] || [ "$got" = "$want" ] || {
  echo "limits read back as $got after writing $want" >&2; exit 1; }' hook "$@"
"""


def host_shortfall(proc_sys: Path = Path("/proc/sys")) -> dict[str, tuple[int, int]]:
    """``{sysctl: (current, wanted)}`` for every host limit below :data:`HOST_SYSCTLS`."""
    short: dict[str, tuple[int, int]] = {}
    for name, want in HOST_SYSCTLS.items():
        path = proc_sys / name.replace(".", "/")
        try:
            have = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            have = -1
        if have < want:
            short[name] = (have, want)
    return short


#: Seconds runc lets the hook run before it fails the container's start. The hook takes
#: milliseconds, but 40 sandboxes starting at once on 2 cores starved it past runc's
#: 10 s default (bench/density.py N=40: "hook ran past specified timeout of 10.0s").
HOOK_TIMEOUT = 60


def _hook_config(script: Path) -> dict[str, object]:
    args = ["sh", str(script)] + [f"{k}={v}" for k, v in sorted(SANDBOX_CAPS.items())]
    # "always": the hooks dir is ours, passed only on agentbox's own `podman run`s.
    return {
        "version": "1.0.0",
        "hook": {"path": "/bin/sh", "args": args, "timeout": HOOK_TIMEOUT},
        "when": {"always": True},
        "stages": ["prestart"],
    }


def hooks_dir(cache_dir: Path) -> Path:
    """Write (once per content) the OCI hooks dir that caps a sandbox's user namespace.

    The hook script (:data:`HOOK_SCRIPT`) is root-owned and read-only: runc runs it
    as root. A path another user could have written is refused.
    """
    config_key = json.dumps([sorted(SANDBOX_CAPS.items()), HOOK_TIMEOUT]).encode()
    digest = hashlib.sha256(HOOK_SCRIPT.encode() + config_key).hexdigest()[:16]
    root = cache_dir / "oci-hooks" / digest
    hooks = root / "hooks.d"
    script = root / "userns_hook.sh"
    if not (hooks / _HOOK_NAME).exists():
        hooks.mkdir(parents=True, exist_ok=True)
        for d in (root.parent, root, hooks):
            d.chmod(0o755)
        _write(script, HOOK_SCRIPT.encode(), 0o555)
        config = json.dumps(_hook_config(script), indent=1).encode()
        _write(hooks / _HOOK_NAME, config, 0o444)
    _check_owned(cache_dir, [root.parent, root, hooks, script, hooks / _HOOK_NAME])
    return hooks


def _check_owned(cache_dir: Path, paths: list[Path]) -> None:
    """The runtime runs the hook as root: nobody else may have written any part of it."""
    me = os.geteuid()
    for path in paths:
        st = path.lstat()
        if st.st_uid != me or st.st_mode & 0o022 or path.is_symlink():
            raise UnsupportedError(
                f"OCI hook path {path} is not owned by uid {me} or is writable by others",
                fix=f"remove {cache_dir / 'oci-hooks'} (agentbox rewrites it)",
            )


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)
