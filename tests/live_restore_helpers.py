"""What the live-restore tests share (``tests/e2e/test_live_restore*.py``): the world
of a served launcher, its kills, and the checks that nothing was lost, run twice or left.
See ``tests/e2e/test_live_restore.py`` for what the chaos test does."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.gateway import read_usage
from agentbox.launcher import LauncherClient, TaskRequest
from agentbox.launcher._names import data_label, list_task_gateways
from agentbox.launcher._store import Store
from agentbox.linux.cgroups import ENTER_THEN_EXEC, unit_hierarchies
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

ROOT = Path(__file__).resolve().parents[1]

# Read at import: the suite's autouse fixture scrubs AGENTBOX_* from the environment.
CHAOS_TASKS = int(os.environ.get("AGENTBOX_CHAOS_TASKS", "2"))
CHAOS_KILLS = os.environ.get("AGENTBOX_CHAOS_KILLS", "")
CHAOS_SEED = os.environ.get("AGENTBOX_CHAOS_SEED", "")
ARTIFACTS = Path(os.environ.get("AGENTBOX_TEST_ARTIFACTS", "/var/tmp/agentbox-test-artifacts"))
#: The phases: each way of killing (``pid``, ``group``, ``cgroup``) and how many times.
CHAOS_WAYS = [
    (way, int(CHAOS_KILLS or n))
    for way, _, n in (
        w.partition(":")
        for w in os.environ.get("AGENTBOX_CHAOS_WAYS", "pid:8,group:8,cgroup:4").split(",")
    )
]

CHAOS_SCRIPT = """\
name: chaos
turns:
  - text: "Writing, then some work."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/chaos.txt", content: "made by the agent\\n"}
  - tool_use:
      - name: Bash
        input: {command: "sleep 5", description: "Some work", timeout: 120000}
  - text: "Done."
"""

SLOW_SCRIPT = """\
name: slow
turns:
  - text: "Writing, then a long command."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/partial.txt", content: "written before the deadline\\n"}
  - tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(600)'"
          description: "A long command"
          timeout: 600000
  - text: "Done."
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


class UnitCgroup:
    """A ``….service`` cgroup in the hierarchies systemd tracks units by, as a unit's."""

    def __init__(self, name: str) -> None:
        mounts = unit_hierarchies()
        mine = Path("/proc/self/cgroup").read_text()
        # Only where this process sits at a hierarchy's root (no unit of ours to disturb).
        self.dirs = [
            m / name
            for key, m in mounts.items()
            if (f":{key}:/\n" if key != "0" else "0::/\n") in mine
        ]
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    def enter(self) -> None:
        """Move the calling process in (run in the launcher's child before exec)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text("0")

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return found

    def kill(self) -> None:
        """What systemd does to a unit's cgroup: SIGKILL everything in it, until empty."""
        end = time.monotonic() + 30
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < end, f"the unit cgroup would not empty: {pids}"
            time.sleep(0.05)

    def remove(self) -> None:
        """Remove the unit cgroups, and the gateways' cgroup beside them once it is empty
        (the launcher makes it on first use and leaves it: a test leaves nothing)."""
        from agentbox.gateway._process import GATEWAY_CGROUP

        for d in self.dirs:
            for gone in (d, d.parent / GATEWAY_CGROUP):
                with contextlib.suppress(OSError):
                    gone.rmdir()


class Served:
    """``agentbox launcher serve`` as a child process in its own session (and unit cgroup)."""

    def __init__(self, env: dict[str, str], sock: Path, unit: UnitCgroup | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=unit.enter if unit is not None else None,
        )  # fmt: skip
        end = time.monotonic() + 90
        while not sock.exists():
            assert self.proc.poll() is None, "launcher exited"
            assert time.monotonic() < end, "launcher did not listen"
            time.sleep(0.1)

    def kill(self, how: str, unit: UnitCgroup | None) -> None:
        if how == "cgroup" and unit is not None:
            # What must outlive a unit restart may not be in the unit's cgroup: said here,
            # by name, rather than as a task that hangs later (its monitor killed).
            for pid in unit.pids():
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    argv = proc.cmdline()
                    cmd = " ".join(argv)
                    # A conmon by name (podman's start-up shell names libpod_parent/conmon
                    # in its argv), a monitor (podman's `conmon --version` probe is none).
                    monitor = proc.name() == "conmon" and "--version" not in argv
                    # A shell still entering its cgroup before it execs the gateway (it
                    # leaves the unit first: enter_then_exec) is on its way out.
                    entering = argv[:3] == ["sh", "-c", ENTER_THEN_EXEC]
                    gateway = "agentbox.gateway" in cmd and not entering
                    assert not monitor and not gateway, (
                        f"pid {pid} is in the launcher's unit cgroup, a restart kills it: {cmd}"
                    )
            unit.kill()
        elif how == "group":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


#: docker's phases: fewer kills than podman's (every docker test shares one daemon).
DOCKER_WAYS = [("pid", 6), ("group", 6), ("cgroup", 2)]
#: qemu's: one of each, a kill waits for a running agent (TCG boots a VM in ~a minute).
QEMU_WAYS = [("pid", 1), ("group", 1)]


@dataclass
class World:
    settings: Settings
    env: dict[str, str]
    repo: Path
    sock: Path
    since: str
    factory: Callable[[Backend, Settings], SandboxTracker]
    trackers: dict[str, SandboxTracker] = field(default_factory=dict)

    def track(self, backend: str, task_ids: Iterable[str]) -> None:
        """Register the tasks' sandboxes with the leak guard (checked after the test)."""
        from agentbox.backends import get_backend

        if backend not in self.trackers:
            be = get_backend(backend, self.settings)
            self.trackers[backend] = self.factory(be, self.settings)
        for tid in task_ids:
            self.trackers[backend].track(f"agentbox-task-{tid}")


@contextlib.contextmanager
def world_of(sandbox_factory: Callable[[Backend, Settings], SandboxTracker]) -> Iterator[World]:
    """A served launcher's world (each test module's ``world`` fixture is this)."""
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-live-", dir="/var/tmp"))
    base.chmod(0o711)
    (base / "chaos.yaml").write_text(CHAOS_SCRIPT)
    (base / "slow.yaml").write_text(SLOW_SCRIPT)
    (base / "models.toml").write_text(
        '[models.replay-chaos]\nkind = "replay"\nupstream = "chaos.yaml"\n\n'
        '[models.replay-slow]\nkind = "replay"\nupstream = "slow.yaml"\n'
    )
    (base / "data").mkdir()
    (base / "repos").mkdir()
    repo = base / "repos" / "proj"
    shutil.copytree(ROOT / "demo" / "sample-repo", repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "s")
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    settings = Settings(
        data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
    )
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    try:
        yield World(settings, env, repo, base / "data" / "launcher.sock", since, sandbox_factory)
    finally:
        _remove_leftovers(settings)
        try:
            assert_no_mounts_under(base)  # no workspace disk, no settle mount
        finally:
            if not os.environ.get("E2E_KEEP_DIRS"):
                shutil.rmtree(base, ignore_errors=True)


#: The container engines (their CLI lists and counts containers); qemu keeps records.
ENGINES = ("podman", "docker")


def _our_containers(settings: Settings, engine: str = "podman") -> list[str]:
    out = subprocess.run(
        [engine, "ps", "-a", "--filter", f"label=io.agentbox.data={data_label(settings)}",
         "--format", "{{.Names}}"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()


def _owned(settings: Settings, backend: str) -> list[str]:
    """The sandboxes of this data dir that ``backend`` still has (containers, VMs)."""
    if backend in ENGINES:
        return _our_containers(settings, backend)
    from agentbox.backends import get_backend

    return get_backend(backend, settings).owned()


def _remove_leftovers(settings: Settings) -> None:
    from agentbox.launcher._watchdog import reap_sandbox

    for engine in ENGINES:
        if shutil.which(engine) is None:
            continue
        with contextlib.suppress(subprocess.CalledProcessError):
            for name in _our_containers(settings, engine):
                # Its workspace disk unmounted too.
                reap_sandbox(engine, name, settings.data_dir)
    for _, gw in list_task_gateways(settings):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gw.pid, signal.SIGKILL)


def _created(since: str, prefix: str, engine: str = "podman") -> list[str]:
    """The containers created since ``since`` whose name starts with ``prefix``."""
    if engine == "docker":
        args = ["docker", "events", "--since", since, "--until", str(int(time.time()) + 1),
                "--filter", "event=create", "--format", "{{.Actor.Attributes.name}}"]  # fmt: skip
    else:
        args = ["podman", "events", "--stream=false", "--since", since, "--filter",
                "event=create", "--format", "{{.Name}}"]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [n for n in out.split() if n.startswith(prefix)]


def _launches(settings: Settings, tid: str) -> int:
    """How many times a launcher started task ``tid``'s sandbox (its log says each)."""
    log = (TaskPaths(settings.data_dir, tid).log_dir / "launcher.log").read_text()
    return log.count("running claude in sandbox ")


def _leftover_processes(settings: Settings, allowed: set[int]) -> list[str]:
    """Gateways, watchdogs and conmons of this data dir still running (zombies aside)."""
    needle = str(settings.data_dir)
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if p.info["pid"] in allowed or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if needle in cmd and any(w in cmd for w in ("gateway", "_watchdog", "conmon")):
            found.append(cmd)
    return found


def _agents_running(settings: Settings, ids: list[str]) -> int:
    """How many of ``ids`` have their agent running: a launched sandbox (the store) whose
    agent has asked the model (its gateway's usage), so the sandbox surely exists."""
    store = Store(settings.data_dir / "state.db")
    rows = [store.get(t) for t in ids]
    return sum(
        1
        for r in rows
        if r.status == "running" and r.stage == "launched" and _asked(settings, r.id)
    )


def _asked(settings: Settings, tid: str) -> bool:
    with contextlib.suppress(Exception):
        return read_usage(TaskPaths(settings.data_dir, tid).usage_file).requests >= 1
    return False


def _until_an_agent_runs(settings: Settings, ids: list[str]) -> None:
    """Wait (bounded) until one of ``ids`` has its agent running (or every one ended)."""
    end = time.monotonic() + 900  # a qemu VM boots under TCG
    while _agents_running(settings, ids) == 0:
        store = Store(settings.data_dir / "state.db")
        if all(store.get(t).info().terminal for t in ids):
            return
        assert time.monotonic() < end, "no task's agent came to run"
        time.sleep(0.1)


def _chaos(
    world: World,
    *,
    tasks: int,
    phases: list[tuple[str, int]],
    runtime: str,
    seed: int,
    backend: str = "podman",
) -> None:
    rng = random.Random(seed)
    env = {**world.env, "AGENTBOX_RUNTIME": runtime, "AGENTBOX_BACKEND": backend}
    unit = UnitCgroup(f"agentbox-chaos-{os.getpid()}.service")
    phases = [(w, n) for w, n in phases if w != "cgroup" or unit.dirs]
    served = Served(env, world.sock, unit)
    table: list[tuple[int, str, float, int, int]] = []
    prefix = f"agentbox-task-chaos{seed % 1000}-"
    ids: list[str] = []
    t0 = time.monotonic()
    try:
        with LauncherClient(world.sock, reconnect=90.0) as client:
            for p, (how, kills) in enumerate(phases):
                batch = [f"chaos{seed % 1000}-{p}{i}" for i in range(tasks)]
                world.track(backend, batch)
                for tid in batch:
                    client.submit(TaskRequest(repo=str(world.repo), task="write, work",
                                              model="replay-chaos", deadline=600.0,
                                              task_id=tid))  # fmt: skip
                ids += batch
                for k in range(kills):
                    time.sleep(rng.uniform(0.05, 1.0))
                    if k % 4 == 0:
                        # Every fourth kill waits for one of this phase's agents to run: each
                        # way of killing hits live sandboxes, whatever the seed.
                        _until_an_agent_runs(world.settings, batch)
                    running = sum(1 for t in ids if client.get(t).status == "running")
                    agents = _agents_running(world.settings, ids)
                    served.kill(how, unit)
                    table.append(
                        (len(table), how, round(time.monotonic() - t0, 1), running, agents)
                    )
                    served = Served(env, world.sock, unit)
                if kills:
                    hit = [row for row in table if row[1] == how and row[4]]
                    assert hit, f"no {how} kill hit a running agent: {table}"
            print(f"chaos {backend}/{runtime} seed {seed}: {len(ids)} tasks, {len(table)} kills in "
                  f"{time.monotonic() - t0:.0f} s (n, way, t, running, agents launched): "
                  f"{table}")  # fmt: skip
            end = time.monotonic() + (1800 if backend == "qemu" else 300)
            infos = {}
            for tid in ids:
                try:
                    infos[tid] = client.wait(tid, timeout=max(1.0, end - time.monotonic()))
                except Exception:
                    log = TaskPaths(world.settings.data_dir, tid).log_dir / "launcher.log"
                    print(f"--- {tid}: {client.get(tid)}\n{log.read_text(errors='replace')}")
                    raise
            print(f"chaos seed {seed}: every task ended {time.monotonic() - t0:.0f} s in")
            for tid, info in infos.items():
                if info.status != "done":
                    log = TaskPaths(world.settings.data_dir, tid).log_dir / "launcher.log"
                    print(f"--- {tid}: {info}\n{log.read_text(errors='replace')}")
                assert info.status == "done", (tid, info.status, info.error)
                res = client.result(tid)
                assert res.branch == f"agentbox/{tid}", res
                assert _git(world.repo, "show", f"{res.branch}:chaos.txt") == "made by the agent\n"
                # The whole transcript, once: Claude Code's init and result events once each.
                out = (TaskPaths(world.settings.data_dir, tid).log_dir / "agent.jsonl").read_text()
                assert out.count('"subtype":"init"') == 1, tid
                assert read_usage(TaskPaths(world.settings.data_dir, tid).usage_file).requests >= 3
                # No task ran twice: each task's sandbox was started once, by one launcher.
                assert _launches(world.settings, tid) == 1, tid
        # A kill that hit a running agent left its task to the next launcher to re-adopt.
        logs = [(TaskPaths(world.settings.data_dir, t).log_dir / "launcher.log").read_text()
                for t in ids]  # fmt: skip
        assert any("re-adopted by launcher pid" in text for text in logs), logs
        if backend in ENGINES:  # and the engine created each container exactly once
            created = _created(world.since, prefix, backend)
            assert sorted(created) == sorted(f"agentbox-task-{t}" for t in ids), created
        kills = {how: sum(1 for row in table if row[1] == how) for how, _ in phases}
        hits = {how: sum(1 for row in table if row[1] == how and row[4]) for how, _ in phases}
        # A finished task's follower removes its sandbox after publishing it: give the
        # last ones that time before counting (the launcher still runs).
        left_by = time.monotonic() + 60
        while (left := _owned(world.settings, backend)) and time.monotonic() < left_by:
            time.sleep(1.0)
        line = (f"chaos table {backend}/{runtime} seed {seed}: kills {len(table)} {kills}, "
                f"hits on a running agent {hits}, tasks done {len(infos)}/{len(ids)}, "
                f"sandboxes created {len(ids)} (once each), leftovers {len(left)}")  # fmt: skip
        print(line)
        # Kept beside the failure artifacts: a passing run's table is quoted in notes.
        with contextlib.suppress(OSError):
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            with (ARTIFACTS / "chaos.txt").open("a") as fh:
                fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    finally:
        served.stop()
        unit.kill()
        unit.remove()
    # Nothing orphaned: no container (VM), no gateway, no watchdog of this data dir.
    assert _owned(world.settings, backend) == []
    assert _leftover_processes(world.settings, {os.getpid()}) == []


def _seed() -> int:
    return int(CHAOS_SEED or random.randrange(1 << 30))
