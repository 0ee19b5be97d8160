"""The sandbox's seccomp profile: podman's default, minus user-namespace creation.

podman's default profile allows ``unshare``/``clone`` with any flags, so a
workload can make a new user namespace and, inside it, mount a cgroup
hierarchy or reach kernel code paths that need CAP_SYS_ADMIN in *some*
namespace — the most common route of recent container-escape CVEs. Agents need
none of that. We derive our profile from the host's default (so it keeps up
with the installed podman) and:

* allow ``clone``/``unshare`` only when ``CLONE_NEWUSER`` is not among the flags;
* answer ``clone3`` with ENOSYS: its flags live in a struct seccomp cannot read,
  and libc falls back to ``clone`` on ENOSYS.

Under gVisor (runsc) ``clone3`` stays allowed: its Sentry does not take glibc's
fallback path (threads fail to start with ENOSYS), and a user namespace made there
is the Sentry's own, never the host kernel's. ``unshare`` is still guarded.

The profile is written once per content hash under the cache dir.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from agentbox.errors import UnsupportedError

__all__ = ["DEFAULT_PROFILE", "profile_path"]

DEFAULT_PROFILE = Path("/usr/share/containers/seccomp.json")
CLONE_NEWUSER = 0x10000000
_ENOSYS = 38
_EPERM = 1
_GUARDED = ("clone", "clone3", "unshare")


def _derive(base: dict[str, Any], *, allow_clone3: bool = False) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    for rule in base.get("syscalls", []):
        kept = [n for n in rule.get("names", []) if n not in _GUARDED]
        if kept:
            rules.append({**rule, "names": kept})
    flag_ok = {"index": 0, "value": CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    flag_bad = {
        "index": 0,
        "value": CLONE_NEWUSER,
        "valueTwo": CLONE_NEWUSER,
        "op": "SCMP_CMP_MASKED_EQ",
    }
    rules += [
        {"names": ["clone", "unshare"], "action": "SCMP_ACT_ALLOW", "args": [flag_ok]},
        {
            "names": ["clone", "unshare"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": _EPERM,
            "args": [flag_bad],
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ALLOW"}
        if allow_clone3
        else {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
    ]
    return {**base, "syscalls": rules}


def profile_path(
    cache_dir: Path, base: Path = DEFAULT_PROFILE, *, allow_clone3: bool = False
) -> Path:
    """Write (once) and return the hardened profile derived from ``base``."""
    try:
        raw = base.read_bytes()
        profile = _derive(json.loads(raw), allow_clone3=allow_clone3)
    except (OSError, ValueError) as exc:
        raise UnsupportedError(
            f"cannot read podman's default seccomp profile {base}: {exc}",
            fix="apt-get install golang-github-containers-common",
        ) from exc
    data = json.dumps(profile, indent=1, sort_keys=True).encode()
    digest = hashlib.sha256(data).hexdigest()[:16]
    out = cache_dir / "seccomp" / f"agentbox-{digest}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o644)
        tmp.replace(out)
    return out
