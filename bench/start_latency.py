"""Sandbox start latency: agentbox's podman and docker backends against raw `run --rm`.

Usage: .venv/bin/python bench/start_latency.py [--runs 15] [--runtime runc] [--compass]
       [--no-docker] [--quick]

``--quick``: no docker rows and no ``agentbox exec`` row (a CLI start is seconds under
load; its own bench is the CLI's import time), for a before/after of the backend.

Times, interleaved in the same run (shuffled each round, a short pause before each
step) so machine load and background cleanup hit all alike:

* raw podman run, first output: `podman run --rm` with the *same* hardening flags and
  image (built by the same function the backend uses), Popen → first stdout byte;
* raw podman run, exit: the same, Popen → exit;
* backend create → first output: PodmanBackend.run(spec, ["echo", "x"]), call → first
  chunk through on_stdout (spec built and checked once beforehand, as the CLI does);
* backend run → return: the same call, to its return (container removed by --rm);
* agentbox exec -- true: the CLI process, start → exit (includes Python and CLI imports).
* detached launch → first output: PodmanBackend.launch + follow (the launcher's path,
  ``podman run -d`` under conmon), call → first chunk through follow's on_stdout;
* pool claim → first output: the same call with the product's warm pool on (a private
  data dir, ``pool_size`` 1, refilled before each step, untimed): launch claims a
  pre-started hardened sandbox, binds the workspace disk and the command at claim.
* ... → output in its log: the same calls, to the first byte the sandbox wrote in the
  task's log (what follow then reads; follow's own start, a ``podman inspect``, is
  the difference).
* docker (unless --no-docker or no daemon): raw `docker run --rm` with the same flags the
  docker backend gives the Engine, Popen → first stdout byte; DockerBackend.run, call →
  first chunk and → return. Docker rows are also given as a ratio to raw `docker run`.

With --compass it also times the two ways past podman's own overhead:

* warm pool: `podman exec` into an already running hardened sandbox (same
  confinement; the container start is paid before the request arrives);
* direct OCI runtime: `runc run` on the bundle podman prepared once (`podman
  create` + `podman init`: same config.json, seccomp, caps, userns, mounts and
  rootfs), so each start skips podman and conmon (runc only).

Prints medians and each row's ratio to raw `podman run` (first output).
Target: backend create → first output <= 1.2x raw; pool claim and compass <= 0.5x.

Whatever happens, every sandbox and raw container it started is removed by name
(``finally``), so a failed step leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentbox.backends._seccomp import profile_path
from agentbox.backends.oci._args import entry_argv, image_facts, run_args
from agentbox.backends.oci._cli import env_file
from agentbox.backends.podman import PodmanBackend, _pool, _pool_ends
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
        argv = run_args(s, settings, facts, detach=True, env_file=envf.path)  # type: ignore[arg-type]
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


DOCKER_RAW = "raw docker run --rm: first output"
LAUNCH_ROW = "detached launch -> first output"
POOL_ROW = "pool claim -> first output"
#: (backend, name) of every sandbox and raw container started: removed in ``finally``.
MADE: list[tuple[str, str]] = []
#: Steps whose sandbox produced no output (each printed after the table).
FAILED: list[str] = []


def docker_argv(name: str, settings: Settings, body: dict[str, Any]) -> list[str]:
    """``docker run --rm`` with the flags of the docker backend's create body (same
    seccomp profile, limits, mounts, user, entrypoint and runtime)."""
    hc = body["HostConfig"]
    argv = ["docker", "run", "--rm", "--name", name, "--network", "none", "--read-only",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--security-opt", f"seccomp={profile_path(settings.cache_dir)}",
            "--ipc", "private", "--cgroupns", "private", "--user", body["User"],
            "--pids-limit", str(hc["PidsLimit"]), "--memory", str(hc["Memory"]),
            "--memory-swap", str(hc["MemorySwap"]), "--cpus", str(hc["NanoCpus"] / 1e9),
            "--runtime", hc["Runtime"], "--workdir", body["WorkingDir"],
            "--entrypoint", body["Entrypoint"][0]]  # fmt: skip
    for u in hc["Ulimits"]:
        argv += ["--ulimit", f"{u['Name']}={u['Soft']}:{u['Hard']}"]
    for path, opts in hc["Tmpfs"].items():
        argv += ["--tmpfs", f"{path}:{opts}"]
    for m in hc["Mounts"]:
        argv += ["-v", f"{m['Source']}:{m['Target']}:{'ro' if m['ReadOnly'] else 'rw'}"]
    return [*argv, body["Image"], *body["Entrypoint"][1:], "echo", "x"]


def docker_steps(
    settings: Settings, box: Boxfile, ws: Path, rows: dict[str, list[float]]
) -> list[Callable[[], None]] | None:
    """The docker rows' steps; None (with a note) when there is no usable daemon."""
    from agentbox.backends.docker import DockerBackend
    from agentbox.backends.docker._config import container_body
    from agentbox.backends.docker._image import ensure_image
    from agentbox.errors import AgentboxError

    be = DockerBackend(settings)
    dbox = box.model_copy(update={"backend": "docker"})
    try:
        spec = spec_from_boxfile(dbox, settings, workspace=ws)
        be.check(spec)
        image_id = ensure_image(be.client, settings, spec.image)
        body = container_body(spec, settings, be.facts(), image_id)
    except AgentboxError as exc:
        print(f"docker rows skipped: {exc}", file=sys.stderr)
        return None
    rows[DOCKER_RAW] = []
    rows["docker backend create -> first output"] = []
    rows["docker backend run -> return"] = []
    counter = iter(range(10**6))

    def raw() -> None:
        name = f"agentbox-bench-raw-{os.getpid()}-{next(counter)}"
        MADE.append(("docker", name))
        rows[DOCKER_RAW].append(first_output(docker_argv(name, settings, body))[0])

    def ours() -> None:
        s = spec_from_boxfile(dbox, settings, workspace=ws)
        be.check(s)
        MADE.append(("docker", s.name))
        got: list[float] = []
        t0 = time.perf_counter()

        def cb(_chunk: bytes) -> None:
            if not got:
                got.append(time.perf_counter() - t0)

        be.run(s, ["echo", "x"], on_stdout=cb)
        rows["docker backend run -> return"].append(time.perf_counter() - t0)
        rows["docker backend create -> first output"].append(got[0])

    return [raw, ours]


def remove_made(settings: Settings) -> None:
    """Remove, by name, every sandbox and raw container the bench started (idempotent:
    most are long gone); a failure is reported, never hides the bench's own error."""
    from agentbox.backends import get_backend

    for name in ("podman", "docker"):
        names = sorted({n for b, n in MADE if b == name})
        if not names:
            continue
        try:
            be = get_backend(name, settings)
            for n in names:
                be.kill(n)
        except Exception as exc:
            print(f"{name}: could not remove the bench's sandboxes: {exc}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--runtime", default="runc")
    ap.add_argument("--compass", action="store_true")
    ap.add_argument("--settle", type=float, default=0.5, help="pause before each step (s)")
    ap.add_argument("--no-docker", action="store_true", help="skip the docker rows")
    ap.add_argument("--quick", action="store_true", help="no docker rows, no CLI row")
    ap.add_argument(
        "--sdk",
        action="store_true",
        help="only raw podman run and the SDK's Sandbox.create() (bench/_sdk_step.py)",
    )
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

    def spec(workspace: Path = ws) -> object:
        s = spec_from_boxfile(box, settings, workspace=workspace)
        backend.check(s)
        MADE.append(("podman", s.name))
        return s

    rows: dict[str, list[float]] = {
        "raw podman run --rm: first output": [],
        "raw podman run --rm: exit": [],
        "backend create -> first output": [],
        "backend run -> return": [],
        **({} if args.quick else {"agentbox exec -- true: start -> exit": []}),
        LAUNCH_ROW: [],
        LAUNCH_ROW.replace("first output", "output in its log"): [],
        POOL_ROW: [],
        POOL_ROW.replace("first output", "output in its log"): [],
    }
    # The product's pool on a private data dir (drained in ``finally``).
    psettings = Settings(data_dir=root / "data", pool_size=1)
    pbackend = PodmanBackend(psettings)
    (root / "logs").mkdir()

    def launched(row: str, be: PodmanBackend, workspace: Path) -> None:
        s = spec_from_boxfile(box, be.settings, workspace=workspace).replace(deadline=120)
        MADE.append(("podman", s.name))
        log = root / "logs" / f"{s.name}.log"
        got: list[float] = []
        t0 = time.perf_counter()

        def cb(_chunk: bytes) -> None:
            if not got:
                got.append(time.perf_counter() - t0)

        seen: list[float] = []
        done = threading.Event()

        def watch() -> None:  # the first byte the sandbox wrote, in the task's log
            while not done.is_set():
                with contextlib.suppress(OSError):
                    if log.stat().st_size > 0:
                        seen.append(time.perf_counter() - t0)
                        return
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            be.launch(s, ["echo", "x"], log=log)
            ended = be.follow(s.name, log=log, on_stdout=cb, on_stderr=None, poll=0.01)
        finally:
            done.set()
            watcher.join()
        if not got:  # counted and shown, never a silent gap in the row
            FAILED.append(f"{row}: no output ({ended})")
            return
        rows[row].append(got[0])
        rows[row.replace("first output", "output in its log")].append(seen[0])

    ws_launch, ws_pool = root / "ws-launch", root / "ws-pool"
    for d in (ws_launch, ws_pool):
        d.mkdir()
        os.chown(d, settings.sandbox_host_uid, settings.sandbox_host_uid)
    template = spec_from_boxfile(box, psettings, workspace=ws_pool).replace(deadline=120)

    def launch_fresh() -> None:
        launched(LAUNCH_ROW, backend, ws_launch)

    def launch_pooled() -> None:
        _pool.fill(pbackend, template, 1, ttl=600)  # untimed: the refill
        launched(POOL_ROW, pbackend, ws_pool)
        # The row is the pool's only if the launch claimed (no fresh fallback).
        assert not list((_pool.pool_dir(psettings) / "slots").glob("*/ready")), "not claimed"

    if args.compass:
        rows["warm pool (podman exec): first output"] = []

    def raw() -> None:
        s = spec_from_boxfile(box, settings, workspace=ws)
        with env_file(s.env) as envf:
            argv = run_args(s, settings, facts, detach=False, env_file=envf.path)
            MADE.append(("podman", s.name))
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

    steps: list[Callable[[], None]] = [raw, ours, launch_fresh, launch_pooled]
    if not args.quick and not args.sdk:
        steps.append(cli)
    sdk = None
    if args.sdk:  # Sandbox.create() -> first output, warm, against the same raw podman run
        from _sdk_step import SdkLauncher

        for name in [n for n in rows if not n.startswith("raw podman run")]:
            del rows[name]
        sdk = SdkLauncher(root)
        steps = [raw, sdk.step(rows)]
    skip_docker = args.no_docker or args.quick or args.sdk
    docker = None if skip_docker else docker_steps(settings, box, ws, rows)
    if docker is not None:
        steps += docker
    warm = None
    oci_name = f"agentbox-bench-oci-{os.getpid()}"
    if args.compass:
        # Its own workspace: a live sandbox holds its workspace (a disk image may be
        # mounted on it), and the other steps start sandboxes on theirs meanwhile.
        ws_warm = root / "ws-warm"
        ws_warm.mkdir()
        os.chown(ws_warm, settings.sandbox_host_uid, settings.sandbox_host_uid)
        warm = backend.create(spec(ws_warm))  # type: ignore[arg-type]

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
        if sdk is not None:
            sdk.stop()
        if warm is not None:
            warm.destroy()
        remove_made(settings)
        _pool_ends.drain(psettings)
        subprocess.run(["podman", "rm", "-f", oci_name], capture_output=True, check=False)
        # runc removes each container's cgroup, not the parent we named in the bundle.
        for d in Path("/sys/fs/cgroup").glob("*/agentbox-bench"):
            for sub in d.glob(f"{oci_name}*"):
                sub.rmdir()
            if not any(p.is_dir() for p in d.iterdir()):
                d.rmdir()
        subprocess.run(["rm", "-rf", str(root)], check=False)

    base = statistics.median(rows["raw podman run --rm: first output"])
    dbase = statistics.median(rows[DOCKER_RAW]) if rows.get(DOCKER_RAW) else None
    print(f"\nstart latency, runtime {args.runtime}, {args.runs} runs each (median)\n")
    print(f"{'measure':50} {'median s':>9} {'min s':>7} {'ratio':>7} {'/docker':>8}")
    for name, vals in rows.items():
        if not vals:
            print(f"{name:50} {'-':>9}  (every run failed: see FAILED below)")
            continue
        med = statistics.median(vals)
        dr = f"{med / dbase:7.2f}x" if dbase and "docker" in name else ""
        print(f"{name:50} {med:9.3f} {min(vals):7.3f} {med / base:6.2f}x {dr:>8}")
    print("\nratio = median / median(raw podman run --rm: first output)")
    for failure in FAILED:
        print(f"FAILED: {failure}")
    if dbase:
        print("/docker = median / median(raw docker run --rm: first output)")


if __name__ == "__main__":
    main()
