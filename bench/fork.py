"""``Sandbox.fork(n)``: what a fork's workspace costs, copied (before) and as an overlay
(now), and what forking a live sandbox takes end to end, in one run.

Usage (as root, after scripts/setup.sh and ``agentbox image build``)::

    .venv/bin/python bench/fork.py [--files 2000] [--mib 200] [--ns 1,2,4] [--backends podman,qemu]

Part 1, the workspace of n forks of a podman/docker sandbox, on this host's data
filesystem: a tree of ``--files`` files holding ``--mib`` MiB (a repository with its
virtualenv) is the parent's frozen copy; then for each n, *before*: n copies of it
(``host_copy``, the ``cp -a --reflink=auto`` each fork used to get), *now*: n
overlays of it (``overlay_workspace``: a loop-mounted layer image of the disk limit,
metadata handed to the fork's uid). Time is the wall time of the n; disk is what the
n take beyond the frozen copy (blocks allocated: the copies' files, the layers' images).

Part 2, end to end through a real launcher: ``Sandbox.create`` of the backend, the
same tree uploaded into its workspace, then ``fork(2)`` timed; the row shows fork
time over create time (both measured here) and the forks' disk beyond the parent's
(qemu: each fork's qcow2 overlay and the one frozen base; podman: the frozen copy and
the layers); for qemu also the VMMs' PSS (proportional: a page shared by k VMs counts
1/k in each) before the fork (the parent) and what each fork added, after one command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentbox.boxfile import DiskLimit
from agentbox.launcher._fork import Lower, host_copy, overlay_workspace

UID_PARENT, UID_FORK = 300000, 301000


def make_tree(root: Path, files: int, mib: int) -> None:
    """``files`` files in dirs of 100 holding ``mib`` MiB in all (random bytes)."""
    size = mib * 1024**2 // max(files, 1)
    for i in range(files):
        d = root / f"d{i // 100}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.py").write_bytes(os.urandom(size))


def blocks(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        # not into a mount (a fork's overlay shows its lower's blocks; its layer is an image)
        dirnames[:] = [n for n in dirnames if not os.path.ismount(Path(dirpath) / n)]
        for n in dirnames + filenames:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / n).lstat().st_blocks * 512
    return total


def workspace_part(files: int, mib: int, ns: list[int]) -> None:
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-fork-", dir="/var/tmp"))
    base.chmod(0o711)  # the copier (the parent's uid) starts in it, as in data_dir/scratch
    try:
        lower_dir = base / "lower"
        lower_dir.mkdir()
        make_tree(lower_dir, files, mib)
        for p in [lower_dir, *lower_dir.rglob("*")]:
            os.lchown(p, UID_PARENT, UID_PARENT)
        print(f"\n## fork workspaces: {files} files, {mib} MiB (data fs: {base})\n")
        print("| n | copies (before) s | overlays (now) s | time now/before "
              "| copies MiB | overlays MiB | disk now/before |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        limit = DiskLimit(size=20 * 1024**3, inodes=1310720)
        for n in ns:
            subprocess.run(["sync"], check=True)
            t0 = time.monotonic()
            copies = []
            for i in range(n):
                dst = base / f"copy{i}"
                dst.mkdir()
                host_copy(lower_dir, dst, src_uid=UID_PARENT, dst_uid=UID_FORK)
                copies.append(dst)
            subprocess.run(["sync"], check=True)
            t_copy = time.monotonic() - t0
            d_copy = sum(blocks(c) for c in copies)
            for c in copies:
                shutil.rmtree(c)
            lower = Lower(lower_dir)
            lower.hold()  # kept for the next n
            with contextlib.ExitStack() as stack:
                t0 = time.monotonic()
                for i in range(n):
                    ws = base / f"ws{i}"
                    ws.mkdir()
                    overlay_workspace(lower, ws, uid=UID_FORK, limit=limit, stack=stack)
                subprocess.run(["sync"], check=True)
                t_ovl = time.monotonic() - t0
                d_ovl = sum((base / f"ws{i}.fork" / "layer.img").stat().st_blocks * 512
                            for i in range(n))  # fmt: skip
            lower.drop()
            for i in range(n):
                (base / f"ws{i}").rmdir()
            mib_c, mib_o = d_copy / 1024**2, d_ovl / 1024**2
            print(f"| {n} | {t_copy:.2f} | {t_ovl:.2f} | {t_ovl / t_copy:.2f} | "
                  f"{mib_c:.1f} | {mib_o:.1f} | {d_ovl / d_copy:.2f} |")  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)


def vmm_pss(base: Path) -> int:
    """The PSS of every QEMU of the launcher under ``base`` (its jail's bwrap names it)."""
    import psutil

    total = 0
    for p in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if not (p.info["name"] or "").startswith("qemu-system"):
                continue
            up = p.parents()[:3]
            if any(str(base) in " ".join(q.cmdline()) for q in up):
                total += p.memory_full_info().pss
    return total


def sdk_part(backends: list[str], files: int, mib: int) -> None:
    from agentbox.sdk import Sandbox

    src = Path(tempfile.mkdtemp(prefix="agentbox-bench-fork-src-"))
    make_tree(src, files, mib)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-fork-sdk-", dir="/var/tmp"))
    base.chmod(0o711)
    env = {"PATH": os.environ["PATH"], "HOME": str(base), "AGENTBOX_DATA_DIR": str(base / "data")}
    serve = subprocess.Popen([sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    try:
        sock = base / "data" / "launcher.sock"
        for _ in range(600):
            if sock.exists():
                break
            time.sleep(0.1)
        print(f"\n## fork(2) end to end: {files} files, {mib} MiB in the workspace\n")
        print("| backend | create s | fork(2) s | fork/create | forks' disk MiB "
              "| VM PSS before MiB | per fork MiB | per fork/parent |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for be in backends:
            t0 = time.monotonic()
            with Sandbox.create(backend=be, timeout=900, address=sock) as sb:
                t_create = time.monotonic() - t0
                sb.upload(src, "/workspace")
                before = blocks(base / "data")
                pss0 = vmm_pss(base)
                t0 = time.monotonic()
                forks = sb.fork(2, timeout=600)
                t_fork = time.monotonic() - t0
                disk = blocks(base / "data") - before
                for f in forks:  # each fork touches its memory a little, as a command would
                    f.commands.run("true")
                per = (vmm_pss(base) - pss0) / 2
                for f in forks:
                    f.close()
            mem = "| - | - | - |" if not pss0 else (
                f"| {pss0 / 1024**2:.0f} | {per / 1024**2:.0f} | {per / pss0:.2f} |")  # fmt: skip
            print(f"| {be} | {t_create:.2f} | {t_fork:.2f} | {t_fork / t_create:.2f} "
                  f"| {disk / 1024**2:.1f} {mem}")  # fmt: skip
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(180)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--backends", default="podman,qemu")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (loop and overlay mounts)")
    print(f"cores: {os.cpu_count()}")
    workspace_part(args.files, args.mib, [int(x) for x in args.ns.split(",")])
    if args.backends:
        sdk_part(args.backends.split(","), args.files, args.mib)


if __name__ == "__main__":
    main()
