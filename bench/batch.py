"""A batch on 3 local Ray nodes against the same tasks on one local launcher, equal slots.

Usage: .venv/bin/python bench/batch.py [--tasks 12] [--nodes 3] [--slots 1]
       [--noop-tasks 300]

Needs root, podman, the default image, Claude Code and the ``agentbox[ray]`` extra.
Every task is a short replay-model task (the real Claude Code in podman writes one
file through its gateway), published as ``agentbox/<id>`` into a driver-side repo.

1. **Wall time, Ray vs local.** ``--nodes`` Ray nodes on this host, each made by
   ``agentbox node start`` (Ray as ``agentbox-node``, token authentication), each
   advertising ``--slots`` ``agentbox_slot`` and feeding its own root launcher (own
   data dir) over its socket; then one in-process
   launcher with ``nodes x slots`` slots (the local executor: same driver, same
   bundles, no Ray). Prints both walls and the ratio (target: Ray <= 1.15x).
2. **Per-task overhead by phase** (medians). Both runs place at most ``nodes x slots``
   attempts at once, so no attempt waits in a queue it cannot see. Phases:
   ``placement`` (placed on the driver to received on the node: Ray's scheduling
   and the base bundle's transfer; ~0 locally), ``unbundle`` (the node's repo from
   the bundle), ``queued`` (submitted to the node's launcher until its sandbox
   started: the launcher's queue, the workspace copy, the gateway), ``task`` (the task
   itself), ``bundle`` (the result branch bundled), ``return`` (the outcome's way
   back), ``publish`` (fetched and published on the driver); ``overhead`` is the
   per-task sum of placement, unbundle, bundle, return and publish.
3. **Scheduling throughput**: ``--noop-tasks`` attempts through the full driver
   (SQLite state, budget, events) onto node actors that answer at once (a no-op
   backend), in tasks placed per second; and the driver alone (an executor that
   answers in-process) for comparison.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

WRITE = """\
name: write
turns:
  - text: "Writing the file."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/bench.txt", content: "made in a batch\\n"}
  - text: "Done."
"""

ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@b",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@b",
}


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        if args[0] == "add":
            (path / "README.md").write_text("bench\n")
        subprocess.run(["git", "-C", str(path), *args], env=ENV, check=True)
    return path


def overrides(base: Path, name: str) -> dict[str, str]:
    for sub in ("data", "repos"):
        (base / name / sub).mkdir(parents=True, exist_ok=True)
    return {
        "data_dir": str(base / name / "data"),
        "repos_root": str(base / name / "repos"),
        "models_file": str(base / "models.toml"),
    }


def tasks_for(repo: Path, n: int, tag: str) -> list[tuple[str, Any]]:
    from agentbox.cluster import BatchTask

    return [(f"{tag}{i}", BatchTask(repo=str(repo), task=f"write {i}")) for i in range(n)]


PHASES = ("placement", "unbundle", "queued", "task", "bundle", "return", "publish", "total")
#: What the scale-out adds to a task (all but the task itself and any queueing).
OVERHEAD = ("placement", "unbundle", "bundle", "return", "publish")


def phases(results: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in PHASES:
        vals = [r.timings[k] for r in results if k in r.timings]
        out[k] = statistics.median(vals) if vals else float("nan")
    per_task = [sum(r.timings.get(k, 0.0) for k in OVERHEAD) for r in results]
    out["overhead"] = statistics.median(per_task) if per_task else float("nan")
    return out


def run_local(base: Path, repo: Path, n: int, slots: int, tag: str) -> tuple[float, list[Any]]:
    from agentbox.cluster import LocalExecutor, NodeService, run_batch
    from agentbox.config import load_settings

    svc = NodeService(load_settings(**overrides(base, "local")), slots=slots, name="local")
    ex = LocalExecutor(svc)
    t0 = time.monotonic()
    try:
        got = list(
            run_batch(
                tasks_for(repo, n, tag),
                executor=ex,
                state_dir=base / "batches",
                batch_id=tag,
                deadline=600,
                max_in_flight=slots,
            )
        )
    finally:
        ex.close()
        svc.close()
    return time.monotonic() - t0, got


class NoopNode:
    """A node actor whose every attempt ends at once (the no-op backend); it proves
    itself with its node key like the real one."""

    def __init__(self, name: str, key: str, slots: int) -> None:
        self.name, self.key, self.slots = name, bytes.fromhex(key), slots

    def prove(self, nonce: str) -> dict[str, Any]:
        from agentbox.cluster._secure import proof

        info = self.info()
        return {**info, "proof": proof(self.key, nonce, str(info["node_id"]), self.name)}

    def run(self, attempt: dict[str, Any], bundle: bytes) -> dict[str, Any]:
        return {"attempt_id": attempt["attempt_id"], "node": self.name, "status": "done"}

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "node": self.name,
            "slots": self.slots,
            "active": [],
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def cancel(self, attempt_id: str) -> bool:
        return False


class InstantExecutor:
    """The driver alone: every attempt is answered in-process, at once."""

    def put(self, data: bytes) -> object:
        return data

    def place(self, attempt: Any, bundle: object, *, node: str | None) -> Any:
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        fut.set_result({"attempt_id": attempt.attempt_id, "node": "x", "status": "done"})
        return fut

    def is_lost(self, exc: BaseException) -> bool:
        return False

    def where(self) -> dict[str, str]:
        return {}

    def cancel(self, attempt_id: str) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--noop-tasks", type=int, default=300)
    args = ap.parse_args()

    import socket
    import sys

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from agentbox.cluster import RayExecutor, connect, run_batch
    from agentbox.cluster._ray import NAMESPACE, actor_name
    from agentbox.cluster._secure import keygen, load_secrets, node_key

    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-", dir="/var/tmp"))
    base.chmod(0o711)
    (base / "write.yaml").write_text(WRITE)
    (base / "models.toml").write_text(
        'default = "replay-write"\n'
        '[models.replay-write]\nkind = "replay"\nupstream = "write.yaml"\n'
    )
    sec = load_secrets(keygen(base / "secrets"))
    repo = make_repo(base / "driver" / "proj")
    total_slots = args.nodes * args.slots
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sk.getsockname()[1]}"
    launchers: list[subprocess.Popen[bytes]] = []
    node_ids: dict[str, str] = {}
    try:
        # Warm-up: one task through the local launcher (image and page cache warm for both).
        run_local(base, repo, 1, 1, "warm")
        local_wall, local_res = run_local(base, repo, args.tasks, total_slots, "local")

        t0 = time.monotonic()
        for i in range(args.nodes):
            o = overrides(base, f"n{i}")
            (base / f"n{i}").chmod(0o711)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AGENTBOX_"))}
            env.update(AGENTBOX_DATA_DIR=o["data_dir"], AGENTBOX_REPOS_ROOT=o["repos_root"],
                       AGENTBOX_MODELS_FILE=o["models_file"],
                       AGENTBOX_CLUSTER_SECRETS=str(base / "secrets"))  # fmt: skip
            launchers.append(subprocess.Popen(
                [sys.executable, "-m", "agentbox", "launcher", "serve",
                 "--max-tasks", str(args.slots)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            ))  # fmt: skip
            sock = Path(o["data_dir"]) / "run" / "launcher.sock"
            while not sock.exists():
                time.sleep(0.2)
            where = ["--head", "--port", address.rsplit(":", 1)[1]] if i == 0 else [
                "--address", address]  # fmt: skip
            subprocess.run(
                [sys.executable, "-m", "agentbox", "node", "start", *where, "--slots",
                 str(args.slots), "--name", f"n{i}", "--ray-arg=--num-cpus=1",
                 "--ray-arg=--object-store-memory=104857600"],
                env=env, check=True,
            )  # fmt: skip
        connect(address, sec=sec)
        for info in RayExecutor(cluster_key=sec.key).nodes():
            node_ids[str(info["node"])] = str(info["node_id"])
        startup = time.monotonic() - t0
        t0 = time.monotonic()
        ray_res = list(
            run_batch(
                tasks_for(repo, args.tasks, "ray"),
                executor=RayExecutor(cluster_key=sec.key),
                state_dir=base / "batches",
                batch_id="ray",
                deadline=600,
                max_in_flight=total_slots,
            )
        )
        ray_wall = time.monotonic() - t0
        bad = [r for r in ray_res + local_res if r.status != "done"]
        assert not bad, bad

        # Scheduling throughput: no-op node actors in place of the real ones.
        for node_id in node_ids.values():
            ray.kill(ray.get_actor(actor_name(node_id), namespace=NAMESPACE))
        time.sleep(1)
        noop = ray.remote(num_cpus=0)(NoopNode)
        actors = []
        for name, node_id in node_ids.items():
            pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
            a = noop.options(
                name=actor_name(node_id),
                namespace=NAMESPACE,
                max_concurrency=64,
                scheduling_strategy=pin,
            ).remote(name, node_key(sec.key, name).hex(), args.slots)
            ray.get(a.info.remote())
            actors.append(a)
        t0 = time.monotonic()
        got = list(
            run_batch(
                tasks_for(repo, args.noop_tasks, "noop"),
                executor=RayExecutor(cluster_key=sec.key),
                state_dir=base / "batches",
                batch_id="noop",
            )
        )
        noop_rate = len(got) / (time.monotonic() - t0)
        t0 = time.monotonic()
        got = list(
            run_batch(
                tasks_for(repo, args.noop_tasks, "inst"),
                executor=InstantExecutor(),
                state_dir=base / "batches",
                batch_id="inst",
            )
        )
        inst_rate = len(got) / (time.monotonic() - t0)
    finally:
        ray.shutdown()
        subprocess.run([sys.executable, "-m", "agentbox", "node", "stop"], check=False)
        for proc in launchers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            proc.wait()
        shutil.rmtree(base, ignore_errors=True)

    lp, rp = phases(local_res), phases(ray_res)
    print(
        f"{args.tasks} replay tasks, {args.nodes} nodes x {args.slots} slots vs one launcher "
        f"with {total_slots} slots (Ray cluster start-up, not counted: {startup:.1f} s)"
    )
    print(f"{'':24}{'local':>10}{'ray':>10}")
    print(f"{'wall (s)':24}{local_wall:10.1f}{ray_wall:10.1f}   ratio {ray_wall / local_wall:.2f}")
    for k in (*PHASES, "overhead"):
        print(f"{'median ' + k + ' (s)':24}{lp[k]:10.2f}{rp[k]:10.2f}")
    print(
        f"scheduling throughput, no-op nodes: {noop_rate:.0f} tasks/s over Ray; "
        f"{inst_rate:.0f} tasks/s for the driver alone ({args.noop_tasks} tasks)"
    )


if __name__ == "__main__":
    main()
