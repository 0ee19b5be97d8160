"""Sandbox start latency: agentbox's podman backend against raw `podman run --rm`.

Usage: .venv/bin/python bench/start_latency.py [--runs 15] [--runtime runc] [--compass]

Times, interleaved in the same run (shuffled each round, a short pause before each
step) so machine load and background cleanup hit all alike:

* raw podman run, first output: `podman run --rm` with the *same* hardening flags and
  image (built by the same function the backend uses), Popen → first stdout byte;
* raw podman run, exit: the same, Popen → exit;
* backend create → first output: PodmanBackend.run(spec, ["echo", "x"]), call → first
  chunk through on_stdout (spec built and checked once beforehand, as the CLI does);
* backend run → return: the same call, to its return (container removed by --rm);
* agentbox exec -- true: the CLI process, start → exit (includes Python and CLI imports).

With --compass it also times the two ways past podman's own overhead:

* warm pool: `podman exec` into an already running hardened sandbox (same
  confinement; the container start is paid before the request arrives);
* direct OCI runtime: `runc run` on the bundle podman prepared once (`podman
  create` + `podman init`: same config.json, seccomp, caps, userns, mounts and
  rootfs), so each start skips podman and conmon (runc only).

Prints medians and each row's ratio to raw `podman run` (first output).
Target: backend create → first output <= 1.2x raw; compass <= 0.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agentbox.backends._podman_args import entry_argv, image_facts, run_args
from agentbox.backends._podman_util import env_file
from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.sandbox import spec_from_boxfile

AGENTBOX = str(Path(sys.executable).parent / "agentbox")


def first_output(argv: list[str]) -> tuple[float, float]:
    """(seconds to first stdout byte, seconds to exit) of ``argv``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    p.stdout.read(1)
    t1 = time.perf_counter()
    p.stdout.read()
    p.wait()
    return t1 - t0, time.perf_counter() - t0


def prepare_bundle(
    settings: Settings, box: Boxfile, ws: Path, facts: object, name: str, root: Path
) -> Path:
    """Let podman build the hardened OCI bundle once (``create`` + ``init``), then reuse
    its config.json (same seccomp, caps, userns, mounts, rootfs) for ``runc run``."""
    s = spec_from_boxfile(box, settings, workspace=ws, name=name)
    with env_file(s.env) as envf:
        argv = run_args(s, settings, facts, detach=True, env_file=envf)  # type: ignore[arg-type]
        i = argv.index("run")
        argv[i : i + 2] = ["create"]  # "run -d" -> "create"
        subprocess.run([*argv, "echo", "x"], check=True, capture_output=True)
    subprocess.run(["podman", "init", name], check=True, capture_output=True)
    cfg_path = subprocess.run(
        ["podman", "inspect", "--format", "{{.OCIConfigPath}}", name],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["process"]["terminal"] = False
    cfg["linux"]["cgroupsPath"] = f"/agentbox-bench/{name}"
    cfg["hooks"] = {}
    bundle = root / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--runtime", default="runc")
    ap.add_argument("--compass", action="store_true")
    ap.add_argument("--settle", type=float, default=0.5, help="pause before each step (s)")
    args = ap.parse_args()

    settings = Settings()
    backend = PodmanBackend(settings)
    root = Path(tempfile.mkdtemp(prefix="bench-", dir="/var/tmp"))
    root.chmod(0o711)
    ws = root / "ws"
    ws.mkdir()
    os.chown(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
    box = Boxfile(runtime=args.runtime)
    facts = image_facts(settings.image)

    def spec() -> object:
        s = spec_from_boxfile(box, settings, workspace=ws)
        backend.check(s)
        return s

    rows: dict[str, list[float]] = {
        "raw podman run --rm: first output": [],
        "raw podman run --rm: exit": [],
        "backend create -> first output": [],
        "backend run -> return": [],
        "agentbox exec -- true: start -> exit": [],
    }
    if args.compass:
        rows["warm pool (podman exec): first output"] = []

    def raw() -> None:
        s = spec_from_boxfile(box, settings, workspace=ws)
        with env_file(s.env) as envf:
            argv = run_args(s, settings, facts, detach=False, env_file=envf)
            first, done = first_output(argv + entry_argv(s, ["echo", "x"]))
        rows["raw podman run --rm: first output"].append(first)
        rows["raw podman run --rm: exit"].append(done)

    def ours() -> None:
        s = spec()
        got: list[float] = []
        t0 = time.perf_counter()

        def cb(_chunk: bytes) -> None:
            if not got:
                got.append(time.perf_counter() - t0)

        backend.run(s, ["echo", "x"], on_stdout=cb)  # type: ignore[arg-type]
        rows["backend run -> return"].append(time.perf_counter() - t0)
        rows["backend create -> first output"].append(got[0])

    def cli() -> None:
        t0 = time.perf_counter()
        subprocess.run([AGENTBOX, "exec", "--runtime", args.runtime, "--", "true"], check=True)
        rows["agentbox exec -- true: start -> exit"].append(time.perf_counter() - t0)

    steps: list[Callable[[], None]] = [raw, ours, cli]
    warm = None
    oci_name = f"agentbox-bench-oci-{os.getpid()}"
    if args.compass:
        warm = backend.create(spec())  # type: ignore[arg-type]

        def pool() -> None:
            assert warm is not None
            first, _ = first_output(["podman", "exec", warm.name, "echo", "x"])
            rows["warm pool (podman exec): first output"].append(first)

        steps.append(pool)
        if args.runtime == "runc":
            rows["direct runc run (podman's bundle): first output"] = []
            bundle = prepare_bundle(settings, box, ws, facts, oci_name, root)
            counter = iter(range(10**6))

            def direct() -> None:
                cid = f"{oci_name}-{next(counter)}"
                argv = ["runc", "--root", str(root / "runc"), "run", "--bundle", str(bundle), cid]
                first, _ = first_output(argv)
                rows["direct runc run (podman's bundle): first output"].append(first)

            steps.append(direct)
    try:
        for step in steps:  # warm-up: page cache, image facts
            step()
        for v in rows.values():
            v.clear()
        rng = random.Random(1)
        for _ in range(args.runs):
            # Shuffled each round, with a pause: a step must not pay for the previous
            # one's background work (conmon's `podman container cleanup` after --rm).
            order = steps[:]
            rng.shuffle(order)
            for step in order:
                time.sleep(args.settle)
                step()
    finally:
        if warm is not None:
            warm.destroy()
        subprocess.run(["podman", "rm", "-f", oci_name], capture_output=True, check=False)
        # runc removes each container's cgroup, not the parent we named in the bundle.
        for d in Path("/sys/fs/cgroup").glob("*/agentbox-bench"):
            for sub in d.glob(f"{oci_name}*"):
                sub.rmdir()
            if not any(p.is_dir() for p in d.iterdir()):
                d.rmdir()
        subprocess.run(["rm", "-rf", str(root)], check=False)

    base = statistics.median(rows["raw podman run --rm: first output"])
    print(f"\nstart latency, runtime {args.runtime}, {args.runs} runs each (median)\n")
    print(f"{'measure':45} {'median s':>9} {'min s':>7} {'ratio':>7}")
    for name, vals in rows.items():
        med = statistics.median(vals)
        print(f"{name:45} {med:9.3f} {min(vals):7.3f} {med / base:6.2f}x")
    print("\nratio = median / median(raw podman run --rm: first output)")


if __name__ == "__main__":
    main()
