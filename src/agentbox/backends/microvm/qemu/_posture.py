"""The live posture of a microVM sandbox (qemu, firecracker), read off the running VMM
and from inside the guest.

Host side: for **every thread** of the QEMU process, ``/proc/<pid>/task/<tid>/status``
(CapEff, NoNewPrivs, Seccomp, Uid); its namespaces against ours; its cgroups'
pids and memory limits. Inside: the guest's kernel (from the per-command
check), no ``/dev/kvm``, no interface but ``lo``, the uid commands run as.
Nothing here comes from configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.backends.base import Posture, PostureCheck
from agentbox.errors import AgentboxError

if TYPE_CHECKING:
    from agentbox.backends.microvm.qemu._sandbox import QemuSandbox

NAMESPACES = ("mnt", "pid", "ipc", "uts", "net")


@dataclass(frozen=True)
class ThreadStatus:
    """The security-relevant lines of one thread's status file."""

    tid: int
    cap_eff: int
    no_new_privs: int
    seccomp: int
    uids: tuple[int, ...]


def thread_status(pid: int) -> list[ThreadStatus]:
    """Every thread of ``pid`` as :class:`ThreadStatus`."""
    out = []
    for tid in sorted((p.name for p in Path(f"/proc/{pid}/task").iterdir()), key=int):
        fields: dict[str, str] = {}
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            k, _, v = line.partition(":")
            fields[k] = v.strip()
        out.append(ThreadStatus(
            int(tid), int(fields.get("CapEff", "f" * 16), 16),
            int(fields.get("NoNewPrivs", "0")), int(fields.get("Seccomp", "0")),
            tuple(int(x) for x in fields.get("Uid", "-1").split()),
        ))  # fmt: skip
    return out


def _cgroup_limits(pid: int) -> dict[str, str]:
    limits: dict[str, str] = {}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return limits
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        root = Path("/sys/fs/cgroup")
        if ctrls == "":
            base = root / path.lstrip("/")
            for key in ("pids.max", "memory.max"):
                if (base / key).exists():
                    limits[key.split(".")[0]] = (base / key).read_text().strip()
        elif "pids" in ctrls.split(","):
            f = root / "pids" / path.lstrip("/") / "pids.max"
            if f.exists():
                limits["pids"] = f.read_text().strip()
        elif "memory" in ctrls.split(","):
            f = root / "memory" / path.lstrip("/") / "memory.limit_in_bytes"
            if f.exists():
                limits["memory"] = f.read_text().strip()
    return limits


def vmm_checks(pid: int, *, want_uid: int, strict: bool, accel: str = "tcg") -> list[PostureCheck]:
    """Host-side checks of the VMM process ``pid``."""
    threads = thread_status(pid)
    checks: list[PostureCheck] = []

    def add(name: str, expected: str, seen: str, ok: bool) -> None:
        checks.append(PostureCheck(name, expected, seen, ok, "host"))

    add("vmm threads read", ">0", str(len(threads)), bool(threads))
    caps = {f"{t.cap_eff:x}" for t in threads}
    add("vmm CapEff (every thread)", "0", ",".join(sorted(caps)),
        bool(threads) and all(t.cap_eff == 0 for t in threads))  # fmt: skip
    add("vmm NoNewPrivs (every thread)", "1",
        ",".join(sorted({str(t.no_new_privs) for t in threads})),
        bool(threads) and all(t.no_new_privs == 1 for t in threads))  # fmt: skip
    add("vmm Seccomp (every thread)", "2", ",".join(sorted({str(t.seccomp) for t in threads})),
        bool(threads) and all(t.seccomp == 2 for t in threads))  # fmt: skip
    uids = {u for t in threads for u in t.uids}
    add("vmm uid", str(want_uid), ",".join(map(str, sorted(uids))), uids == {want_uid})
    if strict:
        add("vmm uid is not the invoking user's", f"!= {os.getuid()}",
            ",".join(map(str, sorted(uids))), os.getuid() not in uids)  # fmt: skip
    for ns in NAMESPACES:
        try:
            theirs = str(Path(f"/proc/{pid}/ns/{ns}").readlink())
            ours = str(Path(f"/proc/self/ns/{ns}").readlink())
        except OSError as exc:
            add(f"vmm own {ns} namespace", "differs from the host's", str(exc), False)
            continue
        add(f"vmm own {ns} namespace", f"!= {ours}", theirs, theirs != ours)
    limits = _cgroup_limits(pid)
    pids = limits.get("pids", "max")
    add("vmm pids limit", "a number", pids, pids.isdigit())
    mem = limits.get("memory", "max")
    add("vmm memory limit", "< unlimited", mem, mem.isdigit() and int(mem) < 1 << 50)
    kvm_visible = Path(f"/proc/{pid}/root/dev/kvm").exists()
    add("vmm jail holds /dev/kvm only under kvm", "absent" if accel != "kvm" else "present",
        "present" if kvm_visible else "absent", kvm_visible == (accel == "kvm"))  # fmt: skip
    return checks


def read_posture(sb: QemuSandbox) -> Posture:
    """Both sides of a live :class:`~agentbox.backends.microvm.qemu.QemuSandbox`."""
    checks: list[PostureCheck] = []
    pid = sb.vm.vmm_pid()
    strict = sb.spec.isolation == "strict"
    checks += vmm_checks(pid, want_uid=sb.vm.cfg.uid, strict=strict, accel=sb.vm.cfg.accel)
    try:
        res = sb.exec(["/bin/sh", "-c",
                       "id -u; ls /sys/class/net | tr '\\n' ' '; echo;"
                       " if [ -e /dev/kvm ]; then echo kvm; else echo nokvm; fi"],
                      timeout=60)  # fmt: skip
        lines = [*res.stdout.decode(errors="replace").splitlines(), "", "", ""]
    except AgentboxError as exc:
        lines = [f"error: {exc}", "", ""]
    assert sb.session is not None
    facts = sb.session.last_check
    host = sb.session.host
    rel = str(facts.get("release", "?"))
    checks.append(PostureCheck("guest kernel is its own", f"!= {host.release}", rel,
                               rel not in ("?", host.release)))  # fmt: skip
    boot = str(facts.get("boot_id", "?"))
    checks.append(PostureCheck("guest boot id is its own", f"!= {host.boot_id}", boot,
                               boot not in ("?", host.boot_id)))  # fmt: skip
    checks.append(PostureCheck("command uid", str(sb.spec.uid), lines[0].strip(),
                               lines[0].strip() == str(sb.spec.uid)))  # fmt: skip
    nets = lines[1].split()
    checks.append(PostureCheck("guest interfaces", "lo", " ".join(nets), nets == ["lo"]))
    checks.append(PostureCheck("no /dev/kvm in guest", "nokvm", lines[2].strip(),
                               lines[2].strip() == "nokvm"))  # fmt: skip
    return Posture(sb.backend.name, f"{sb.vm.cfg.accel}", tuple(checks))
