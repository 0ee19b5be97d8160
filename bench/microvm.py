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
  idle memory   RSS and PSS of one idle VMM (snapshot-restored and cold)

Targets (from the issue): cold <= 1.1x bare; snapshot <= 0.2x cold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil

from agentbox.backends.base import SandboxSpec
from agentbox.backends.qemu import QemuBackend
from agentbox.boxfile import Resources
from agentbox.config import Settings
from agentbox.microvm import boot_to_marker, ensure_root_disk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="1GiB")
    args = ap.parse_args()

    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-"))
    settings = Settings(data_dir=tmp)
    root = (info.rootfs, info.hash)
    res = Resources(memory=args.memory, cpus=1)
    root_disk = ensure_root_disk(settings, *root)
    warm = QemuBackend(settings, rootfs=root)
    cold = QemuBackend(settings, rootfs=root, cold=True)
    accel = warm.accel()

    def first_command(backend: QemuBackend, i: int) -> float:
        spec = SandboxSpec(name=f"bench-{i}", image="default", resources=res)
        t0 = time.monotonic()
        with backend.create(spec) as sb:
            out = sb.exec(["true"])
            took = time.monotonic() - t0
            assert out.exit_code == 0
        return took

    # warm-ups: caches (root disk, initramfs, snapshot) are made outside the timings
    first_command(warm, 0)
    bare: list[float] = []
    colds: list[float] = []
    snaps: list[float] = []
    for i in range(args.runs):  # interleaved, so host load drifts affect all rows alike
        t0 = time.monotonic()
        ok, detail = boot_to_marker(
            settings, accel=accel, timeout=120, root_disk=root_disk,
            memory_mib=res.memory // 2**20, cpus=1,
        )  # fmt: skip
        if not ok:
            print(f"bare boot failed: {detail}", file=sys.stderr)
            return 1
        bare.append(time.monotonic() - t0)
        colds.append(first_command(cold, i + 1))
        snaps.append(first_command(warm, i + 100))

    mem: dict[str, tuple[float, float]] = {}
    for label, backend in (("snapshot", warm), ("cold", cold)):
        spec = SandboxSpec(name=f"bench-mem-{label}", image="default", resources=res)
        with backend.create(spec) as sb:
            sb.exec(["true"])
            time.sleep(2)
            m = psutil.Process(sb.vm.vmm_pid()).memory_full_info()
            mem[label] = (m.rss / 2**20, m.pss / 2**20)

    b, c, s = (statistics.median(x) for x in (bare, colds, snaps))
    print(f"microVM boot paths, accel={accel}, guest memory {args.memory}, runs={args.runs}")
    print(f"{'path':<38}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>16}")
    print(f"{'bare QEMU to marker (baseline)':<38}{b:>10.2f}{min(bare):>8.2f}{max(bare):>8.2f}"
          f"{'1.00x bare':>16}")  # fmt: skip
    print(f"{'cold: create + first command':<38}{c:>10.2f}{min(colds):>8.2f}{max(colds):>8.2f}"
          f"{c / b:>10.2f}x bare")  # fmt: skip
    print(f"{'snapshot: create + first command':<38}{s:>10.2f}{min(snaps):>8.2f}{max(snaps):>8.2f}"
          f"{s / c:>10.2f}x cold")  # fmt: skip
    for label, (rss, pss) in mem.items():
        print(f"idle VMM memory ({label}): RSS {rss:.0f} MiB, PSS {pss:.0f} MiB")
    print(f"targets: cold <= 1.10x bare -> {'met' if c / b <= 1.1 else 'NOT met'}; "
          f"snapshot <= 0.20x cold -> {'met' if s / c <= 0.2 else 'NOT met'}")  # fmt: skip
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
