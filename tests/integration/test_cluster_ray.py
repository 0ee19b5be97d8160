"""A batch on a real local Ray cluster, as `agentbox node start` makes one: several Ray
nodes on this host, each run by `ray start` as the unprivileged user ``agentbox-node``
with token authentication, each with its own root launcher (own data dir, repos root and
model registry) reached over its socket, the real Claude Code in podman driven by the
replay model, and the branches landing in the driver's repos.

One cluster serves the module (starting Ray nodes costs ~20 s each on 2 cores): a head
and two more nodes of one slot each (``agentbox_slot``), so three tasks run at once, one
per node. The issue asks for 12 tasks on the spread test; on our 2 cores it runs 6 (two
per node). The tests run in file order; the node-kill test is last, because it takes a
node away.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from agentbox.cluster import BatchEvent, BatchResult, BatchTask, RayExecutor, run_batch
from git_helpers import git

pytestmark = [
    pytest.mark.ray,
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="each node's launcher runs as root"),
]

WRITE = """\
name: write
turns:
  - text: "Writing the file."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/cluster.txt", content: "made on a node\\n"}
    usage: {input_tokens: 3000, output_tokens: 20}
  - text: "Done."
    usage: {input_tokens: 3000, output_tokens: 5}
"""

SLOW = """\
name: slow
turns:
  - tool_use:
      - name: Bash
        input: {command: "sleep 6", description: "Think for a while", timeout: 600000}
  - text: "Writing the file."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/slow.txt", content: "made slowly\\n"}
  - text: "Done."
"""

Completed = subprocess.CompletedProcess[str]
RAY_ARGS = ["--ray-arg=--num-cpus=1", "--ray-arg=--object-store-memory=104857600"]


@dataclass
class LocalCluster:
    """Ray nodes started by ``agentbox node start`` (Ray as ``agentbox-node``), each with
    its own launcher; this process is the driver, connected with the token."""

    base: Path
    address: str
    env: dict[str, str]
    secrets: Path
    key: bytes
    launchers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    node_ids: dict[str, str] = field(default_factory=dict)
    """name → Ray node id."""

    def node_env(self, name: str, **more: str) -> dict[str, str]:
        root = self.base / name
        for sub in ("data", "repos"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)
        (root / "repos").chmod(0o711)
        return {
            **self.env,
            "AGENTBOX_DATA_DIR": str(root / "data"),
            "AGENTBOX_REPOS_ROOT": str(root / "repos"),
            "AGENTBOX_MODELS_FILE": str(self.base / "models.toml"),
            **more,
        }

    def launcher(self, name: str) -> None:
        env = self.node_env(name)
        with (self.base / f"{name}.launcher.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentbox", "launcher", "serve", "--max-tasks", "1"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.launchers[name] = proc
        sock = Path(env["AGENTBOX_DATA_DIR"]) / "run" / "launcher.sock"
        end = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < end, f"launcher {name} died"
            time.sleep(0.2)

    def start(
        self, name: str, *, head: bool = False, **more: str
    ) -> subprocess.CompletedProcess[str]:
        where = ["--head", "--port", self.address.rsplit(":", 1)[1]] if head else [
            "--address", self.address]  # fmt: skip
        return subprocess.run(
            [sys.executable, "-m", "agentbox", "node", "start", *where, "--slots", "1",
             "--name", name, *RAY_ARGS],
            env=self.node_env(name, **more), capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    def add(self, name: str, *, head: bool = False) -> None:
        self.launcher(name)
        got = self.start(name, head=head)
        assert got.returncode == 0, got.stderr[-3000:]

    def attempts_run(self, prefix: str) -> list[str]:
        """Task ids starting with ``prefix`` in every node's launcher store."""
        import sqlite3

        out = []
        for db in self.base.glob("*/data/state.db"):
            con = sqlite3.connect(db)
            try:
                out += [
                    r[0]
                    for r in con.execute("SELECT id FROM tasks WHERE id LIKE ?", (prefix + "%",))
                ]
            finally:
                con.close()
        return sorted(out)

    def kill_node(self, node_id: str) -> None:
        """Take the Ray node away: its raylet (and with it the node's workers) is killed."""
        for p in _ray_procs():
            if f"--node_id={node_id}" in " ".join(p.info["cmdline"] or []):
                p.kill()


def _ray_procs() -> list[psutil.Process]:
    """Every Ray process of the node user (ours: the user is agentbox's own)."""
    import pwd

    uid = pwd.getpwnam("agentbox-node").pw_uid
    return [
        p
        for p in psutil.process_iter(["cmdline", "uids", "status"])
        if p.info["uids"]
        and p.info["uids"].real == uid
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


@pytest.fixture(scope="module")
def ray_cluster(sandbox_root: Path, default_image: str) -> Iterator[LocalCluster]:
    ray = pytest.importorskip("ray", reason="the agentbox[ray] extra is not installed")
    from agentbox.cluster._secure import keygen, load_secrets

    base = Path(tempfile.mkdtemp(dir=sandbox_root))
    base.chmod(0o711)
    (base / "write.yaml").write_text(WRITE)
    (base / "slow.yaml").write_text(SLOW)
    (base / "models.toml").write_text(
        'default = "replay-write"\n'
        '[models.replay-write]\nkind = "replay"\nupstream = "write.yaml"\n'
        '[models.replay-slow]\nkind = "replay"\nupstream = "slow.yaml"\n'
    )
    secrets = keygen(base / "secrets")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AGENTBOX_"))}
    env["AGENTBOX_CLUSTER_SECRETS"] = str(secrets)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lc = LocalCluster(base, f"127.0.0.1:{port}", env, secrets, load_secrets(secrets).key)
    sessions = Path("/var/lib/agentbox-node/tmp/ray")
    before = set(sessions.glob("session_2*"))
    try:
        lc.add("n0", head=True)
        lc.add("n1")
        lc.add("n2")
        from agentbox.cluster import connect

        connect(lc.address, sec=load_secrets(secrets))
        for info in RayExecutor(cluster_key=lc.key).nodes():
            lc.node_ids[str(info["node"])] = str(info["node_id"])
        assert sorted(lc.node_ids) == ["n0", "n1", "n2"]
        yield lc
    finally:
        ray.shutdown()
        procs = _ray_procs()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        for proc in lc.launchers.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in lc.launchers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        left = _ray_procs()
        shutil.rmtree(base, ignore_errors=True)
        for old in set(sessions.glob("session_2*")) - before:  # our sessions' logs
            shutil.rmtree(old, ignore_errors=True)
        assert not left, f"Ray processes survived the cluster: {left}"


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def _branches(repo: Path) -> list[str]:
    out = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/agentbox/")
    return sorted(out.split())


def _run(
    lc: LocalCluster,
    tmp: Path,
    batch_id: str,
    tasks: list[tuple[str, BatchTask]],
    on_event: Callable[[BatchEvent], None] | None = None,
    **kw: Any,
) -> list[BatchResult]:
    return list(
        run_batch(
            tasks,
            executor=RayExecutor(refresh=0.5, cluster_key=lc.key),
            state_dir=tmp / "batches",
            batch_id=batch_id,
            on_event=on_event,
            deadline=300,
            **kw,
        )
    )


def _peak(events: list[BatchEvent]) -> int:
    """The most attempts in flight at once, from the driver's own events."""
    now = peak = 0
    for e in events:
        if e.event == "placed" and not e.detail:
            now += 1
        elif e.event in ("finished", "lost"):
            now -= 1
        peak = max(peak, now)
    return peak


def test_a_batch_spreads_over_the_nodes_and_every_branch_lands(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    repos = [_repo(tmp_path / "alpha"), _repo(tmp_path / "beta")]
    tasks = [
        (f"t{i}", BatchTask(repo=str(repos[i % 2]), task=f"write a file ({i})")) for i in range(6)
    ]
    got = _run(ray_cluster, tmp_path, "spread", tasks)
    assert [r.status for r in got] == ["done"] * 6, got
    assert {r.node for r in got} == {"n0", "n1", "n2"}
    assert _branches(repos[0]) == ["agentbox/spread-t0", "agentbox/spread-t2", "agentbox/spread-t4"]
    assert _branches(repos[1]) == ["agentbox/spread-t1", "agentbox/spread-t3", "agentbox/spread-t5"]
    for r in got:
        repo = repos[int(r.key[1:]) % 2]
        assert git(repo, "show", f"{r.branch}:cluster.txt") == "made on a node\n"
        assert git(repo, "rev-parse", f"{r.branch}~1") == git(repo, "rev-parse", "main")
        assert r.tokens > 0 and {"unbundle", "run", "bundle", "publish"} <= set(r.timings)
    # The nodes' own repos and launchers hold the tasks; the driver's repo only the branches.
    assert ray_cluster.attempts_run("spread-") == [f"spread-t{i}" for i in range(6)]


def test_the_batch_budget_holds_under_concurrency(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Three slots, but a batch budget that covers two tasks' budgets: never three at once,
    and the tokens every task spent (metered by each node's real gateway) stay within it."""
    repo = _repo(tmp_path / "proj")
    events: list[BatchEvent] = []
    tasks = [(f"t{i}", BatchTask(repo=str(repo), task="write")) for i in range(3)]
    got = _run(
        ray_cluster, tmp_path, "budget", tasks, events.append, budget=700_000, task_budget=300_000
    )
    assert [r.status for r in got] == ["done"] * 3, got
    assert _peak(events) == 2
    assert 0 < sum(r.tokens for r in got) <= 700_000


def test_a_node_with_a_broken_setup_is_refused_with_the_reason(ray_cluster: LocalCluster) -> None:
    import ray

    before = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    got = ray_cluster.start("broken", AGENTBOX_IMAGE="localhost/agentbox-missing:1")
    assert got.returncode != 0
    assert "this host cannot be a node: image:" in got.stderr and "agentbox-missing" in got.stderr
    assert "Traceback" not in got.stderr
    assert [n["NodeID"] for n in ray.nodes() if n["Alive"]] == before  # nothing joined


def test_a_client_without_the_token_is_refused(ray_cluster: LocalCluster) -> None:
    """The cluster's GCS refuses a client that has no token (Ray's token authentication),
    and answers the same client given the token (the control)."""
    from agentbox.cluster import _secure

    assert _secure.cluster_is_open(ray_cluster.address) is False
    token = (ray_cluster.secrets / "ray-token").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with tempfile.TemporaryDirectory() as home:
        env.update(HOME=home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        got = subprocess.run(
            [sys.executable, "-c", _secure._PROBE, ray_cluster.address],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr[-2000:]


def test_a_cluster_without_token_authentication_is_refused(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    """A Ray head started the old way (authentication off): ``agentbox batch run`` and
    ``agentbox node start`` refuse it, naming the fix, and nothing is placed on it.
    Control: the module's cluster (token on) is accepted by the same probe."""
    from agentbox.cluster import _secure

    raytmp = tempfile.mkdtemp(prefix="rayopen", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=raytmp, RAY_AUTH_MODE="disabled", HOME=raytmp)
    subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
         "--num-cpus=1", "--object-store-memory=104857600", "--include-dashboard=false",
         "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    try:
        assert _secure.cluster_is_open(f"127.0.0.1:{port}") is True
        assert _secure.cluster_is_open(ray_cluster.address) is False  # the control
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"repo": str(_repo(tmp_path / "r")), "task": "x"}) + "\n")
        env = {**os.environ, "AGENTBOX_CLUSTER_SECRETS": str(ray_cluster.secrets)}
        got = subprocess.run(
            [sys.executable, "-m", "agentbox", "batch", "run", str(tasks), "--address",
             f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "b")],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert got.returncode != 0
        assert "runs without token authentication" in got.stderr, got.stderr[-2000:]
        assert "RAY_AUTH_MODE=token" in got.stderr and "Traceback" not in got.stderr
        assert not (tmp_path / "b").exists()  # refused before any batch state
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if raytmp in " ".join(p.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        shutil.rmtree(raytmp, ignore_errors=True)


def test_ray_and_every_task_pinned_to_a_node_run_unprivileged(ray_cluster: LocalCluster) -> None:
    """A client holding the token pins a task to each node: it runs as ``agentbox-node``
    (group ``agentbox``), not root, and cannot read /etc/shadow; no raylet or GCS of the
    cluster runs as root."""
    import grp
    import pwd

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pw = pwd.getpwnam("agentbox-node")
    gid = grp.getgrnam("agentbox").gr_gid

    def who() -> tuple[int, int, list[int], str]:
        import os as _os

        try:
            with open("/etc/shadow") as fh:
                fh.read(1)
            shadow = "read"
        except PermissionError:
            shadow = "refused"
        return _os.getuid(), _os.geteuid(), sorted(_os.getgroups()), shadow

    remote = ray.remote(num_cpus=0)(who)
    for name, node_id in ray_cluster.node_ids.items():
        pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
        uid, euid, groups, shadow = ray.get(remote.options(scheduling_strategy=pin).remote())
        assert (uid, euid) == (pw.pw_uid, pw.pw_uid) and uid != 0, name
        assert gid in groups or pw.pw_gid == gid
        assert shadow == "refused"
    daemons = [
        p
        for p in psutil.process_iter(["cmdline", "uids"])
        if any(x in " ".join(p.info["cmdline"] or []) for x in ("raylet/raylet", "gcs_server"))
        and "/var/lib/agentbox-node/tmp/ray" in " ".join(p.info["cmdline"] or [])
    ]
    assert len(daemons) >= 4  # three raylets and the GCS
    assert {p.info["uids"].real for p in daemons} == {pw.pw_uid}


def test_a_fake_node_actor_gets_nothing(ray_cluster: LocalCluster, tmp_path: Path) -> None:
    """A Ray peer holding the token joins with an ``agentbox_slot`` and registers an actor
    under the node-actor name for its node, answering every call; it cannot prove itself
    (no cluster key), so no attempt, task text or bundle ever reaches it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from agentbox.cluster._ray import NAMESPACE, actor_name

    raytmp = tempfile.mkdtemp(prefix="rayfake", dir="/tmp")
    got_file = tmp_path / "fake-got.txt"
    got_file.touch()
    got_file.chmod(0o666)
    token = (ray_cluster.secrets / "ray-token").read_text()
    env = {**os.environ, "RAY_TMPDIR": raytmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor"}  # fmt: skip
    marker = "fake_peer_marker"
    subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={ray_cluster.address}",
         "--num-cpus=1", "--object-store-memory=104857600", "--disable-usage-stats",
         f"--resources={json.dumps({'agentbox_slot': 4, marker: 1})}"],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    try:
        fake_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and marker in n["Resources"])

        class Fake:
            def __init__(self, node_id: str, out: str) -> None:
                self.node_id, self.out = node_id, out

            def info(self) -> dict[str, object]:
                return {"node": "n9", "slots": 4, "active": [], "node_id": self.node_id}

            def prove(self, nonce: str) -> dict[str, object]:
                return {**self.info(), "proof": "0" * 64}

            def run(self, attempt: dict[str, Any], bundle: bytes) -> dict[str, Any]:
                with open(self.out, "a") as fh:
                    fh.write(attempt["attempt_id"] + "\n")
                return {"attempt_id": attempt["attempt_id"], "node": "n9", "status": "failed"}

            def cancel(self, attempt_id: str) -> bool:
                return False

        fake = (
            ray.remote(num_cpus=0)(Fake)
            .options(
                name=actor_name(fake_id),
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(fake_id, soft=False),
            )
            .remote(fake_id, str(got_file))
        )
        ray.get(fake.info.remote())
        repo = _repo(tmp_path / "proj")
        tasks = [(f"t{i}", BatchTask(repo=str(repo), task="write")) for i in range(4)]
        ex = RayExecutor(refresh=0.5, cluster_key=ray_cluster.key)
        got = list(
            run_batch(tasks, executor=ex, state_dir=tmp_path / "batches", batch_id="fake",
                      deadline=300)
        )  # fmt: skip
        assert [r.status for r in got] == ["done"] * 4, got
        assert {r.node for r in got} <= {"n0", "n1", "n2"}
        assert got_file.read_text() == "", "the fake node actor was sent an attempt"
        assert actor_name(fake_id) in ex.refused and "failed the proof" in str(ex.refused)
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if raytmp in " ".join(p.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        shutil.rmtree(raytmp, ignore_errors=True)


def test_a_killed_driver_resumes_and_nothing_runs_twice(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    repo = _repo(tmp_path / "proj")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps(
                {"repo": str(repo), "task": f"slow {i}", "model": "replay-slow", "key": f"k{i}"}
            )
            + "\n"
            for i in range(3)
        )
    )
    argv = [
        sys.executable,
        "-m",
        "agentbox",
        "batch",
        "run",
        str(tasks),
        "--json",
        "--address",
        ray_cluster.address,
        "--batch",
        "resume",
        "--state-dir",
        str(tmp_path / "batches"),
        "--deadline",
        "300",
        "--max-in-flight",
        "2",
    ]
    env = {**os.environ, "AGENTBOX_CLUSTER_SECRETS": str(ray_cluster.secrets)}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(json.loads(line))
            if seen[-1]["event"] == "finished":
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver dies mid-batch
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert any(e["event"] == "finished" for e in seen), seen
    got = list(
        run_batch(
            None,
            executor=RayExecutor(refresh=0.5, cluster_key=ray_cluster.key),
            state_dir=tmp_path / "batches",
            batch_id="resume",
        )
    )
    assert sorted(r.key for r in got) == ["k0", "k1", "k2"]
    assert [r.status for r in got] == ["done"] * 3, got
    assert not any(r.lost_attempts for r in got)
    # Each task ran exactly once on the nodes, and published exactly once.
    assert ray_cluster.attempts_run("resume-") == [f"resume-k{i}" for i in range(3)]
    assert _branches(repo) == [f"agentbox/resume-k{i}" for i in range(3)]


def test_a_node_killed_mid_batch_loses_no_task_and_duplicates_no_branch(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    """The first worker node seen running an attempt is removed from the cluster (its
    raylet is killed, and the node actor's process dies with it). Its attempt comes back as
    lost and runs again elsewhere as ``<id>-r1``; on the dead node's host its launcher (a
    root service apart from Ray) finishes and removes the sandbox; never published."""
    repo = _repo(tmp_path / "proj")
    killed: list[str] = []

    def kill_first(ev: BatchEvent) -> None:
        if not killed and ev.event == "placed" and ev.node in ("n1", "n2"):
            killed.append(ev.node)
            ray_cluster.kill_node(ray_cluster.node_ids[ev.node])

    tasks = [
        (f"t{i}", BatchTask(repo=str(repo), task="slow", model="replay-slow")) for i in range(3)
    ]
    got = _run(ray_cluster, tmp_path, "kill", tasks, kill_first)
    assert killed, "no attempt was seen running on a worker node"
    assert [r.status for r in got] == ["done"] * 3, got
    lost = [a for r in got for a in r.lost_attempts]
    assert lost and all(f"@{killed[0]}" in a for a in lost), lost
    keys = {r.key for r in got}
    assert len(_branches(repo)) == 3 == len(keys)
    for r in got:
        if r.lost_attempts:
            # Re-run elsewhere as -r1, or -r2 when a loaded host lost the first re-run too.
            assert re.search(r"-r[0-9]+$", r.attempt_id) and r.node != killed[0], r
            assert f"agentbox/{re.sub(r'-r[0-9]+$', '', r.attempt_id)}" not in _branches(repo)
    # The dead node's sandbox does not outlive its task (its launcher settles it).
    dead = [a.split("@")[0] for a in lost]
    end = time.monotonic() + 120
    while time.monotonic() < end:
        names = subprocess.run(
            ["podman", "ps", "-a", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        left = [n for n in names if any(n == f"agentbox-task-{d}" for d in dead)]
        if not left:
            break
        time.sleep(2)
    assert not left, f"the dead node's sandboxes survived: {left}"
