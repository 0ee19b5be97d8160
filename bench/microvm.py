"""Benchmark: microVM boot paths, all measured in the same run on this host.

    .venv/bin/python bench/microvm.py [--runs N] [--memory 1GiB]

Rows:
  bare QEMU     our kernel + initramfs + root disk, same memory and vCPUs, no
                jail, booted to a marker printed by the image's python3 in the
                chroot (the baseline)
  cold          QemuBackend(cold=True): data disk, jail, boot, hello, check,
                first command's output
  snapshot      QemuBackend(): data disk, jail, restore, hello (reseed, mount),
                check, first command's output
  idle memory   per VMM, RSS, PSS and private memory of --idle restored VMs idle
                at once (their untouched guest RAM is the one snapshot memfd's,
                shared), and of one cold VM; then a table of both split by
                mapping class from /proc/<pid>/smaps (guest RAM written / read,
                TCG's code buffer and TB hash table, malloc heap and arenas,
                other anonymous, stacks, binary and libraries private / shared),
                and the restored VM's PSS without the rows that exist only under
                TCG (what a KVM host would not have); then one VM of each runs
                `claude --version` and is measured idle again (TCG's code buffer
                keeps what it translated, up to its cap), with the growth of the
                snapshot's memfd meanwhile

Each row also gives the CPU seconds spent on it (bare: QEMU's until the marker; cold
and snapshot: the VMM's until the first command's output, plus this process's and its
reaped children's): on a host shared with other work, the CPU ratio holds where the
wall-clock one swings with the load.

Targets (from the issue): cold <= 1.1x bare; snapshot <= 0.2x cold; PSS of an idle
restored VM <= 40 MiB.

``--density 2,4,8`` (issue 15) measures instead how many idle sandboxes fit: for
each count k, k snapshot-restored VMs, then k cold-booted ones, all idle at once;
per VM the RSS and PSS of its host processes (the VMM and its jail), the drop of
MemAvailable, and the CPU an idle VMM burns (TCG emulates the guest's timer
ticks). Restored VMs map their memory from the one snapshot file, so their
untouched pages are shared (PSS below RSS); cold ones own all they touched. The
table ends with an extrapolation to a 24 GiB host, and which of memory or CPU
runs out first. Every VM is destroyed in a ``finally``, then the backend's orphan
sweep runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm import ensure_root_disk
from agentbox.backends.microvm._vm import TCG_TB_MIB
from agentbox.backends.microvm.kvm import boot_guest
from agentbox.backends.microvm.qemu import QemuBackend
from agentbox.boxfile import Resources
from agentbox.config import Settings


def mem_available() -> int:
    """MemAvailable in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_vms(backend: QemuBackend, res: Resources, k: int, label: str) -> dict[str, float]:
    """Start k sandboxes, all idle at once; their memory and CPU per VM."""
    boxes: list[Any] = []
    mem0 = mem_available()
    try:
        t0 = time.monotonic()
        for i in range(k):
            spec = SandboxSpec(name=f"bench-density-{label}-{k}-{i}", image="default",
                               resources=res)  # fmt: skip
            boxes.append(backend.create(spec))
            assert boxes[-1].exec(["true"]).exit_code == 0
        started = time.monotonic() - t0
        time.sleep(3)
        pids = [pid for b in boxes for pid in b.host_pids()]
        c0, w0 = cpu_seconds(pids), time.monotonic()
        time.sleep(5)
        cpu = (cpu_seconds(pids) - c0) / (time.monotonic() - w0)
        rss = pss = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                m = psutil.Process(pid).memory_full_info()
                rss, pss = rss + m.rss, pss + m.pss
        drop = mem0 - mem_available()
        return {"k": k, "rss": rss / k / 2**20, "pss": pss / k / 2**20,
                "drop": drop / k / 2**20, "cpu": cpu / k, "start": started}  # fmt: skip
    finally:
        for b in boxes:
            with contextlib.suppress(Exception):
                b.destroy()


def _smaps(pid: int) -> list[tuple[int, int, str, str, dict[str, int]]]:
    """(start, end, perms, name, fields in kB) per mapping of ``pid``."""
    out: list[tuple[int, int, str, str, dict[str, int]]] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            out.append((lo, hi, head[1], head[5] if len(head) > 5 else "", {}))
        elif len(head) == 3 and head[2] == "kB" and out:
            out[-1][4][head[0].rstrip(":")] = int(head[1])
    return out


#: The classes of a VMM's memory, in table order: (key, label, exists only under TCG).
CLASSES = (
    ("ram_cow", "guest RAM written (private: since the restore; a cold VM's all)", False),
    ("ram_read", "guest RAM read from the snapshot (shared pages, this VM's share)", False),
    ("tcg", "TCG translated-code buffer (rwx)", True),
    ("tcg_hash", "TCG translation-block hash table (x-query-jit buckets x 64 B)", True),
    ("heap", "malloc: main heap", False),
    ("arenas", "malloc: thread arenas", False),
    ("anon", "other anonymous (QEMU's mmaps: coroutine stacks, I/O, soft-TLBs)", False),
    ("stacks", "thread stacks (main + each thread's)", False),
    ("lib_priv", "binary + libraries: private (relocations, .data, .bss)", False),
    ("lib_file", "binary + libraries: file pages (shared, this VM's share)", False),
    ("images", "kernel + initrd files QEMU maps (/vm/vmlinux, /vm/initramfs)", False),
)
_ARENA = 64 * 2**20  # glibc's HEAP_MAX_SIZE on 64-bit: thread arenas are aligned to it


def jit_hash_mib(sb: Any) -> float:
    """MiB of TCG's translation-block hash table (QEMU's ``x-query-jit``: its buckets
    are 64 bytes each, one allocation); 0 under KVM or when QEMU does not say."""
    with contextlib.suppress(Exception):
        text = sb.vm.qmp(("x-query-jit", None))[0]["human-readable-text"]
        for line in text.splitlines():
            if line.startswith("TB hash buckets"):
                return int(line.split()[3].split("/")[1]) * 64 / 2**20
    return 0.0


def _thread_sps(pid: int) -> list[int]:
    """Each thread's stack pointer (from ``/proc/<pid>/task/*/syscall``; root reads it)."""
    sps: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (task / "syscall").read_text().split()
            if len(fields) > 2:
                sps.append(int(fields[-2], 16))
    return sps


def breakdown(pid: int, ram_mib: int, tcg_hash: float = 0.0) -> dict[str, tuple[float, float]]:
    """The VMM's RSS and PSS (MiB) per class of :data:`CLASSES`, from its smaps
    (``ram_mib``: the guest's memory, an anonymous mapping that size is a cold VM's
    RAM); ``tcg_hash`` MiB (see :func:`jit_hash_mib`) move from the anonymous row."""
    maps = _smaps(pid)
    sps = _thread_sps(pid)
    tot = {key: [0.0, 0.0] for key, _, _ in CLASSES}
    for lo, hi, perms, name, f in maps:
        rss, pss, anon = f.get("Rss", 0), f.get("Pss", 0), f.get("Anonymous", 0)
        if "agentbox-snapshot-ram" in name:
            tot["ram_cow"][0] += anon
            tot["ram_cow"][1] += anon
            tot["ram_read"][0] += rss - anon
            tot["ram_read"][1] += pss - anon
            continue
        if name.startswith("/vm/"):
            tot["images"][0] += rss
            tot["images"][1] += pss
            continue
        if name.startswith("/"):
            tot["lib_priv"][0] += anon
            tot["lib_priv"][1] += anon
            tot["lib_file"][0] += rss - anon
            tot["lib_file"][1] += pss - anon
            continue
        if name == "[heap]":
            key = "heap"
        elif name.startswith("[stack") or any(lo <= sp < hi for sp in sps):
            key = "stacks"
        elif name.startswith("["):  # [vvar], [vdso], [vsyscall]
            key = "lib_file"
        elif perms == "rwxp":
            key = "tcg"
        elif lo % _ARENA == 0 and perms.startswith("rw"):
            key = "arenas"
        elif hi - lo >= ram_mib * 2**20:
            key = "ram_cow"
        else:
            key = "anon"
        tot[key][0] += rss
        tot[key][1] += pss
    out = {key: (r / 1024, p / 1024) for key, (r, p) in tot.items()}
    moved = min(tcg_hash, out["anon"][0], out["anon"][1])
    out["tcg_hash"] = (moved, moved)
    out["anon"] = (out["anon"][0] - moved, out["anon"][1] - moved)
    return out


def idle_memory(backend: QemuBackend, res: Resources, k: int, label: str) -> dict[str, Any]:
    """k sandboxes idle at once: per VMM, RSS, PSS, private (USS), and the RSS and PSS
    of each class of :data:`CLASSES`."""
    boxes: list[Any] = []
    try:
        for i in range(k):
            spec = SandboxSpec(name=f"bench-mem-{label}-{i}", image="default", resources=res)
            boxes.append(backend.create(spec))
            assert boxes[-1].exec(["true"]).exit_code == 0
        time.sleep(2)
        tot = dict.fromkeys(("rss", "pss", "uss"), 0.0)
        classes = {key: [0.0, 0.0] for key, _, _ in CLASSES}
        for sb in boxes:
            pid = sb.vm.vmm_pid()
            m = psutil.Process(pid).memory_full_info()
            tot["rss"] += m.rss / 2**20
            tot["pss"] += m.pss / 2**20
            tot["uss"] += m.uss / 2**20
            ram = res.memory // 2**20
            for key, (r, p) in breakdown(pid, ram, jit_hash_mib(sb)).items():
                classes[key][0] += r
                classes[key][1] += p
        out: dict[str, Any] = {"k": k, **{key: v / k for key, v in tot.items()}}
        out["classes"] = {key: (r / k, p / k) for key, (r, p) in classes.items()}
        # After real work, idle again: TCG's code buffer keeps what it translated
        # (up to its cap), so one VM runs the agent's CLI once and is measured again.
        sb = boxes[0]
        memfd = snapshot_ram_resident()
        if sb.exec(["claude", "--version"]).exit_code == 0:
            time.sleep(2)
            pid = sb.vm.vmm_pid()
            cls = breakdown(pid, res.memory // 2**20, jit_hash_mib(sb))
            pss = psutil.Process(pid).memory_full_info().pss / 2**20
            out["after_work"] = (pss, cls["tcg"][1] + cls["tcg_hash"][1], cls["ram_cow"][1])
            if memfd is not None and not backend.cold:  # a first touch of a hole adds a page
                out["memfd"] = (memfd, snapshot_ram_resident() or 0.0)
        return out
    finally:
        for sb in boxes:
            with contextlib.suppress(Exception):
                sb.destroy()


def print_breakdown(mem: dict[str, dict[str, Any]]) -> float:
    """The per-class table of each idle row; returns the restored VM's TCG-only PSS."""
    labels = list(mem)
    head = "".join(f" {lab} RSS | {lab} PSS |" for lab in labels)
    print(f"\n| idle VMM memory, MiB per VM (smaps) |{head} TCG only |")
    print("|---|" + "---:|---:|" * len(labels) + "---|")
    for key, text, tcg_only in CLASSES:
        cells = "".join(f" {mem[lab]['classes'][key][0]:.1f} | {mem[lab]['classes'][key][1]:.1f} |"
                        for lab in labels)  # fmt: skip
        print(f"| {text} |{cells} {'yes' if tcg_only else ''} |")
    cells = "".join(f" {mem[lab]['rss']:.1f} | {mem[lab]['pss']:.1f} |" for lab in labels)
    print(f"| total (psutil) |{cells} |")
    cls = mem[labels[0]]["classes"]
    return float(sum(cls[key][1] for key, _, tcg_only in CLASSES if tcg_only))


def snapshot_ram_resident() -> float | None:
    """MiB resident in this process's snapshot memfds (shmem: counted in no VM's PSS)."""
    total = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if "agentbox-snapshot-ram" in os.readlink(fd):
                total += os.stat(fd).st_blocks * 512
    return total / 2**20 if total else None


def density(settings: Settings, root: tuple[Path, str], res: Resources, counts: list[int]) -> int:
    warm = QemuBackend(settings, rootfs=root)
    cold = QemuBackend(settings, rootfs=root, cold=True)
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        with warm.create(SandboxSpec(name="bench-density-warmup", image="default",
                                     resources=res)) as sb:  # fmt: skip
            sb.exec(["true"])  # the snapshot is made outside the measurement
        for k in counts:
            for label, backend in (("restored", warm), ("cold", cold)):
                rows.append((label, idle_vms(backend, res, k, label)))
    finally:
        for backend in (warm, cold):
            with contextlib.suppress(Exception):
                left = backend.cleanup_orphans()
                if left:
                    print(f"orphans removed: {left}", file=sys.stderr)
    host = 24 * 2**30 / 2**20
    ncpu = os.cpu_count() or 1
    print(f"idle microVMs, accel={warm.accel()}, guest memory {res.memory // 2**20} MiB, "
          f"{ncpu} CPUs, MemTotal-based extrapolation to 24 GiB\n")  # fmt: skip
    print(
        "| VMs | kind | RSS MiB/VM | PSS MiB/VM | MemAvailable drop MiB/VM | idle CPU/VM "
        "| start s (all) | fit in 24 GiB (PSS) | fit by CPU |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows:
        by_mem = int(host / max(r["pss"], r["drop"], 1))
        by_cpu = int(ncpu / r["cpu"]) if r["cpu"] > 0 else 10**6
        print(f"| {int(r['k'])} | {label} | {r['rss']:.0f} | {r['pss']:.0f} | {r['drop']:.0f} "
              f"| {r['cpu'] * 100:.1f} % | {r['start']:.1f} | {by_mem} | {by_cpu} |")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="1GiB")
    ap.add_argument("--density", help="comma-separated VM counts: idle density instead")
    ap.add_argument("--idle", type=int, default=4, help="restored VMs idle at once for memory")
    args = ap.parse_args()

    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-"))
    try:
        return measure(args, Settings(data_dir=tmp), (info.rootfs, info.hash))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(args: argparse.Namespace, settings: Settings, root: tuple[Path, str]) -> int:
    res = Resources(memory=args.memory, cpus=1)
    if args.density:
        return density(settings, root, res, [int(k) for k in args.density.split(",")])
    root_disk = ensure_root_disk(settings, *root)
    warm = QemuBackend(settings, rootfs=root)
    cold = QemuBackend(settings, rootfs=root, cold=True)
    accel = warm.accel()

    def own_cpu() -> float:
        """CPU seconds of this process and its reaped children (mkfs, bwrap, ...)."""
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def first_command(backend: QemuBackend, i: int) -> tuple[float, float]:
        """Wall seconds to the first command's output, and the CPU seconds spent on it
        (the VMM's, ours and our children's)."""
        spec = SandboxSpec(name=f"bench-{i}", image="default", resources=res)
        t0, c0 = time.monotonic(), own_cpu()
        with backend.create(spec) as sb:
            out = sb.exec(["true"])
            took = time.monotonic() - t0
            vmm = psutil.Process(sb.vm.vmm_pid()).cpu_times()
            cpu = vmm.user + vmm.system + own_cpu() - c0
            assert out.exit_code == 0
        return took, cpu

    # warm-ups: caches (root disk, initramfs, snapshot) are made outside the timings
    first_command(warm, 0)
    rows: dict[str, list[tuple[float, float]]] = {"bare": [], "cold": [], "snap": []}
    for i in range(args.runs):  # interleaved, so host load drifts affect all rows alike
        t0 = time.monotonic()
        boot = boot_guest(
            settings, accel=accel, timeout=120, root_disk=root_disk,
            memory_mib=res.memory // 2**20, cpus=1,
        )  # fmt: skip
        if not boot.reached:
            print(f"bare boot failed: {boot.detail}", file=sys.stderr)
            return 1
        rows["bare"].append((time.monotonic() - t0, boot.cpu))
        rows["cold"].append(first_command(cold, i + 1))
        rows["snap"].append(first_command(warm, i + 100))
    bare, colds, snaps = ([w for w, _ in rows[k]] for k in ("bare", "cold", "snap"))
    cpu = {k: statistics.median([c for _, c in v]) for k, v in rows.items()}

    mem = {label: idle_memory(backend, res, k, label)
           for label, backend, k in (("snapshot", warm, args.idle), ("cold", cold, 1))}  # fmt: skip

    b, c, s = (statistics.median(x) for x in (bare, colds, snaps))
    print(f"microVM boot paths, accel={accel}, guest memory {args.memory}, runs={args.runs}")
    print(f"{'path':<38}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>16}{'CPU s':>8}"
          f"{'CPU ratio':>16}")  # fmt: skip
    for label, xs, key, ratio, cpu_ratio in (
        ("bare QEMU to marker (baseline)", bare, "bare", "1.00x bare", "1.00x bare"),
        ("cold: create + first command", colds, "cold", f"{c / b:.2f}x bare",
         f"{cpu['cold'] / cpu['bare']:.2f}x bare"),
        ("snapshot: create + first command", snaps, "snap", f"{s / c:.2f}x cold",
         f"{cpu['snap'] / cpu['cold']:.2f}x cold"),
    ):  # fmt: skip
        print(f"{label:<38}{statistics.median(xs):>10.2f}{min(xs):>8.2f}{max(xs):>8.2f}"
              f"{ratio:>16}{cpu[key]:>8.2f}{cpu_ratio:>16}")  # fmt: skip
    for label, m in mem.items():
        print(f"idle VMM memory ({label}, {m['k']:.0f} idle at once, per VM): RSS {m['rss']:.0f} "
              f"MiB, PSS {m['pss']:.0f} MiB, private {m['uss']:.0f} MiB")  # fmt: skip
    tcg = print_breakdown(mem)
    for label, m in mem.items():
        if "after_work" in m:
            pss_w, tcg_w, cow_w = m["after_work"]
            print(f"one {label} VM after `claude --version`, idle again: PSS {pss_w:.1f} MiB, "
                  f"TCG-only {tcg_w:.1f} (code buffer capped at {TCG_TB_MIB} MiB), guest RAM "
                  f"written {cow_w:.1f}")  # fmt: skip
        if "memfd" in m:
            print(f"  the snapshot's memfd (shmem, in no VM's PSS) grew meanwhile from "
                  f"{m['memfd'][0]:.0f} to {m['memfd'][1]:.0f} MiB: a guest's first touch of "
                  "a page the template never used adds a zero page to it")  # fmt: skip
    ram = snapshot_ram_resident()
    if ram is not None:
        print(f"snapshot RAM (one sealed memfd, shared by every restored VM): {ram:.0f} MiB")
    pss, cold_pss = mem["snapshot"]["pss"], mem["cold"]["pss"]
    cold_tcg = sum(mem["cold"]["classes"][key][1] for key, _, tcg_only in CLASSES if tcg_only)
    print(
        f"restored idle VM PSS {pss:.1f} MiB ({pss / cold_pss:.2f}x a cold VM's "
        f"{cold_pss:.1f}), of which {tcg:.1f} MiB exist only under TCG (accel={accel}): "
        f"{pss - tcg:.1f} MiB without them ({(pss - tcg) / (cold_pss - cold_tcg):.2f}x a cold "
        f"VM's {cold_pss - cold_tcg:.1f}; a KVM host has neither; TCG's soft-TLBs, in the "
        "arena and anonymous rows, are not split out)"
    )
    print(f"targets: cold <= 1.10x bare -> {'met' if c / b <= 1.1 else 'NOT met'}; "
          f"snapshot <= 0.20x cold -> {'met' if s / c <= 0.2 else 'NOT met'}; "
          f"restored PSS <= 40 MiB -> {'met' if pss <= 40 else 'NOT met'} "
          f"(without the TCG-only part: {'met' if pss - tcg <= 40 else 'NOT met'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
