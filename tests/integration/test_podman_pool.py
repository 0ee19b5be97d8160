"""The warm pool of podman sandboxes (issue 15 item 3): real podman, runc, mounts.

* a task through the pool runs its command in a sandbox started before it, with its
  workspace, environment and argv bound at claim; its output, exit code and the
  workspace written back come as from a fresh launch; nothing is left;
* two tasks in a row: each gets its own sandbox, and the second sees nothing of the
  first (files in /tmp and home, processes, its workspace);
* a claim race: two processes claim from a pool of one; exactly one wins and the
  other takes the fresh path;
* refill, drain (what ``launcher stop`` does) and the orphan sweep of a dead
  launcher's pool (a next launcher's ``remove_orphans`` reaps it);
* posture: the posture reader's checks on a pooled sandbox equal a fresh one's.

Every pooled slot and task sandbox is registered with the leak guard
(``sandbox_factory``): after the pool is drained, none may leave a process,
container, cgroup, socket or env fd.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends.base import OWNER_DATA_LABEL, SandboxSpec, data_dir_label
from agentbox.backends.oci._posture import read_posture
from agentbox.backends.podman import PodmanBackend, PodmanSandbox
from agentbox.backends.podman import _detach as detach
from agentbox.backends.podman import _pool as pool
from agentbox.backends.podman import _pool_ends as pool_ends
from agentbox.backends.podman import _removals as removals
from agentbox.backends.podman._pool_view import POOL_LABEL
from agentbox.collect._checkout import chown_tree
from agentbox.config import Settings
from agentbox.escape._fixtures import Fixture
from agentbox.escape._probeio import _parse_json, inside_outcomes, probe_source
from agentbox.escape._runner import real_spec
from agentbox.launcher._adopt import remove_orphans
from agentbox.launcher._pool import pool_template, start_pool
from agentbox.launcher._store import Store
from agentbox.linux.mounts import is_mount
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and mounts need root"),
]


def _pooled(settings: Settings, size: int = 1) -> Settings:
    return settings.model_copy(update={"pool_size": size})


def _template(image: str, ws: Path, **kw: object) -> SandboxSpec:
    return SandboxSpec(name="template", image=image, workspace=ws, deadline=120, **kw)  # type: ignore[arg-type]


def _containers(prefix: str, settings: Settings | None = None) -> list[str]:
    """Containers named ``prefix…``; with ``settings``, only those of its data dir (a
    pool's slots carry its owner label: other workers' pools run beside this module)."""
    argv = ["podman", "ps", "-a", "--format", "{{.Names}}"]
    if settings is not None:
        argv += ["--filter", f"label={OWNER_DATA_LABEL}={data_dir_label(settings.data_dir)}"]
    res = subprocess.run(argv, capture_output=True, text=True, check=True)
    return [n for n in res.stdout.split() if n.startswith(prefix)]


def _run(
    tracker: SandboxTracker,
    backend: PodmanBackend,
    spec: SandboxSpec,
    argv: list[str],
    log: Path,
) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    tracker.track(spec.name)
    backend.launch(spec, argv, log=log)
    ended = backend.follow(
        spec.name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.05
    )
    assert removals.wait(spec.name, 120), "the container's removal (off the path) hung"
    return ended, b"".join(out), b"".join(err)


def _fill(
    tracker: SandboxTracker, backend: PodmanBackend, template: SandboxSpec, size: int
) -> list[str]:
    """``pool.fill``, each started slot registered with the leak guard."""
    names = pool.fill(backend, template, size, ttl=120)
    for name in names:
        tracker.track(name)
    return names


@pytest.fixture
def pooled(
    sandbox_settings: Settings, podman_boxes: SandboxTracker
) -> Iterator[tuple[PodmanBackend, Settings]]:
    """A backend whose settings turn the pool on; everything of the pool drained after."""
    settings = _pooled(sandbox_settings)
    backend = PodmanBackend(settings)
    names: list[str] = []
    yield backend, settings
    for name in names:
        with contextlib.suppress(Exception):
            backend.reap(name)
    pool_ends.drain(settings)
    assert removals.wait(timeout=120), "a removal (off the path) hung"
    assert not pool_left(settings), pool_left(settings)
    assert_no_mounts_under(settings.data_dir)


def pool_mounted(settings: Settings) -> bool:
    return is_mount(pool.pool_dir(settings))


def pool_left(settings: Settings) -> list[str]:
    slots = pool.pool_dir(settings) / "slots"
    left = [p.name for p in slots.iterdir()] if slots.is_dir() else []
    return left + _containers(pool.SLOT_PREFIX, settings)


def test_task_through_the_pool(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    backend, settings = pooled
    ws = make_workspace()
    (ws / "in.txt").write_text("from the host\n")
    started = _fill(podman_boxes, backend, _template(default_image, ws), 1)
    assert len(started) == 1 and _containers(started[0]) == started
    spec = _template(default_image, ws).replace(
        name=f"agentbox-pooltest-{os.getpid()}", env={"GREETING": "hello pool"}
    )
    log = tmp_path / "sandbox.log"
    script = (
        'echo "$GREETING"; pwd; cat in.txt; id -u; echo written > out.txt; echo err >&2; exit 3'
    )
    ended, out, err = _run(podman_boxes, backend, spec, ["sh", "-c", script], log)
    assert ended == Exited(3, False)
    assert out.decode().splitlines() == ["hello pool", "/workspace", "from the host", "64000"]
    assert err == b"err\n"
    assert (ws / "out.txt").read_text() == "written\n"
    assert b"hello pool" in log.read_bytes()  # the task's own log holds the output
    assert not _containers(spec.name)
    # single use: the pooled sandbox ran the task and is gone, its slot too
    assert not _containers(started[0])
    assert not pool_left(settings)


def _end(backend: PodmanBackend, name: str, log: Path) -> None:
    backend.kill(name)
    backend.follow(name, log=log, on_stdout=None, on_stderr=None, poll=0.05)
    assert removals.wait(name, 120), "the container's removal (off the path) hung"


def test_posture_pooled_equals_fresh(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    """The posture reader's checks (inside and host) on a pooled sandbox: all pass, and
    they are the same checks with the same outcome as on a fresh sandbox of the spec."""
    backend, settings = pooled
    gw = tmp_path / "gw"
    gw.mkdir(mode=0o755)
    template = _template(default_image, make_workspace(), gateway_dir=gw)
    [slot] = _fill(podman_boxes, backend, template, 1)
    postures = {}
    for kind in ("pooled", "fresh"):
        spec = template.replace(
            name=f"agentbox-pool-{kind}-{os.getpid()}", workspace=make_workspace()
        )
        log = tmp_path / f"{kind}.log"
        podman_boxes.track(spec.name)
        backend.launch(spec, ["sleep", "300"], log=log)
        try:
            info = detach.inspect(spec.name)
            assert info is not None
            labels = info["Config"]["Labels"]
            assert (POOL_LABEL in labels) == (kind == "pooled"), labels
            box = PodmanSandbox(backend, spec, str(info["Id"]))
            postures[kind] = read_posture(box, settings)
        finally:
            _end(backend, spec.name, log)
    assert not _containers(slot)
    for kind, posture in postures.items():
        assert posture.ok, (kind, [c for c in posture.checks if not c.ok])
    assert [(c.name, c.where, c.ok) for c in postures["pooled"].checks] == [
        (c.name, c.where, c.ok) for c in postures["fresh"].checks
    ]


_SNOOP = r"""
ls -A /tmp; echo --; ls -A "$HOME"; echo --; ls -A /workspace; echo --
ps -eo comm= | sort; echo --; hostname
echo secret > /tmp/left-behind; echo secret > "$HOME/left-behind"
echo secret > /workspace/left-behind; (sleep 600 &) ; sleep 0.2
"""


def test_no_state_crosses_between_tasks(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    """Two tasks through a pool of two: each gets its own sandbox; the second sees none
    of the first's files (/tmp, home, workspace), processes or host name."""
    backend, settings = pooled
    template = _template(default_image, make_workspace())
    slots = _fill(podman_boxes, backend, template, 2)
    assert len(slots) == 2
    seen = []
    for i in range(2):
        spec = template.replace(
            name=f"agentbox-pool-seq{i}-{os.getpid()}", workspace=make_workspace()
        )
        ended, out, err = _run(
            podman_boxes, backend, spec, ["sh", "-c", _SNOOP], tmp_path / f"t{i}.log"
        )
        assert ended == Exited(0, False), err
        seen.append(out.decode().split("--\n"))
    assert not pool_left(settings)  # both came from the pool, each used once
    for tmp, home, ws, procs, _host in seen:
        assert "left-behind" not in tmp + home + ws
        assert "sleep" not in procs.split(), procs
    assert seen[0][4] != seen[1][4]  # two sandboxes (the host name is the container id)


_CLAIMER = """
import json, sys, time
from pathlib import Path
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.oci._posture import read_posture
from agentbox.backends.podman import PodmanSandbox
from agentbox.backends.podman import _detach as detach
from agentbox.backends.podman import _pool as pool
from agentbox.backends.podman import _pool_ends as pool_ends
from agentbox.linux.mounts import is_mount
from agentbox.backends.podman._pool_view import POOL_LABEL
from agentbox.escape._fixtures import Fixture
from agentbox.escape._probeio import _parse_json, inside_outcomes, probe_source
from agentbox.escape._runner import real_spec
from agentbox.launcher._adopt import remove_orphans
from agentbox.launcher._pool import pool_template, start_pool
from agentbox.launcher._store import Store
from agentbox.config import Settings
a = json.loads(sys.argv[1])
settings = Settings(data_dir=Path(a["data_dir"]), repos_root=Path(a["repos_root"]),
                    mount_roots=tuple(Path(p) for p in a["mount_roots"]), pool_size=1)
spec = SandboxSpec(name=a["name"], image=a["image"], workspace=Path(a["ws"]), deadline=120)
backend = PodmanBackend(settings)
while not Path(a["go"]).exists():
    time.sleep(0.001)
print(json.dumps(pool.claim(backend, spec, ["echo", a["name"]], log_path=Path(a["log"]))))
"""


def test_claim_race_one_wins(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    """Two processes claim at once from a pool of one: exactly one gets it (the other
    would take the fresh path), and the winner's task runs."""
    backend, settings = pooled
    template = _template(default_image, make_workspace())
    _fill(podman_boxes, backend, template, 1)
    go = tmp_path / "go"
    procs = {}
    for i in range(2):
        name = f"agentbox-pool-race{i}-{os.getpid()}"
        podman_boxes.track(name)
        args = {
            "data_dir": str(settings.data_dir),
            "repos_root": str(settings.repos_root),
            "mount_roots": [str(p) for p in settings.mount_roots],
            "name": name,
            "image": default_image,
            "ws": str(make_workspace()),
            "go": str(go),
            "log": str(tmp_path / f"{name}.log"),
        }
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, json.dumps(args)], stdout=subprocess.PIPE, text=True
        )
    go.touch()
    won = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=120)
        won[name] = json.loads(out.strip().splitlines()[-1])
    assert sorted(won.values()) == [False, True], won
    [winner] = [n for n, w in won.items() if w]
    out_chunks: list[bytes] = []
    ended = backend.follow(
        winner,
        log=tmp_path / f"{winner}.log",
        on_stdout=out_chunks.append,
        on_stderr=None,
        poll=0.05,
    )
    assert ended == Exited(0, False)
    assert b"".join(out_chunks) == f"{winner}\n".encode()
    assert removals.wait(winner, 120), "the container's removal (off the path) hung"
    assert not pool_left(settings)


def test_refill_drain_and_orphan_sweep(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    podman_boxes: SandboxTracker,
) -> None:
    """fill tops the pool up to its size and no further; drain removes every unclaimed
    sandbox and the pool mount; another launcher's orphan sweep leaves a live keeper's
    pool alone, and reaps a dead launcher's pool, slots included."""
    backend, settings = pooled
    template = _template(default_image, make_workspace())
    first = _fill(podman_boxes, backend, template, 2)
    assert len(first) == 2
    assert _fill(podman_boxes, backend, template, 2) == []  # full: nothing started
    assert sorted(_containers(pool.SLOT_PREFIX, settings)) == sorted(first)
    assert sorted(pool_ends.drain(settings)) == sorted(first)
    assert not pool_left(settings)
    assert not pool_mounted(settings)
    # another launcher's reconcile (a foreground `agentbox run` beside the service)
    # leaves a live keeper's pool alone: it used to reap every entry as an orphan
    store = Store(settings.data_dir / "state.db")
    kept = _fill(podman_boxes, backend, template, 1)
    remove_orphans(settings, store)
    assert kept[0] in _containers(pool.SLOT_PREFIX), "a live keeper's pool was reaped"
    assert (pool.pool_dir(settings) / "slots" / kept[0] / "ready").is_file()
    # a launcher that died with a pool: the next one's reconcile reaps what no task holds
    _filled_by_a_dead_launcher(settings, kept[0])
    remove_orphans(settings, store)
    assert not any(n in _containers(pool.SLOT_PREFIX) for n in kept)
    assert not (pool.pool_dir(settings) / "slots" / kept[0]).exists()


def test_a_claim_under_way_is_left_and_one_cut_short_is_reaped(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    podman_boxes: SandboxTracker,
) -> None:
    """A claimed slot whose container still has the slot's name: a claim under way (its
    rename comes last) is left to its claimer; one whose claimer died long ago (the slot
    unchanged for longer than a claim can take) is an orphan, reaped with its slot."""
    backend, settings = pooled
    template = _template(default_image, make_workspace())
    (slot,) = _fill(podman_boxes, backend, template, 1)
    sdir = pool.pool_dir(settings) / "slots" / slot
    (sdir / "ready").rename(sdir / "claimed")  # claimed, as a claimer's first step
    store = Store(settings.data_dir / "state.db")
    remove_orphans(settings, store)
    assert slot in _containers(pool.SLOT_PREFIX), "a claim under way was reaped"
    long_ago = time.time() - 3600
    os.utime(sdir, (long_ago, long_ago))
    remove_orphans(settings, store)
    assert slot not in _containers(pool.SLOT_PREFIX), "a claim cut short was left running"
    assert not sdir.exists()


def _filled_by_a_dead_launcher(settings: Settings, slot: str) -> None:
    """Rewrite ``slot``'s ready record as if a process that has exited had filled it."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    path = pool.pool_dir(settings) / "slots" / slot / "ready"
    ready = json.loads(path.read_text())
    ready.update(filler=gone.pid, filler_start=ready["filler_start"])
    path.unlink()
    pool.write(path, ready, mode=0o600)


def _wait_ready(settings: Settings, n: int, *, but: frozenset[str] = frozenset()) -> set[str]:
    """Slots with a ready record (bounded wait for the keeper's thread, not a timing test)."""
    end = time.monotonic() + 180
    while time.monotonic() < end:
        found = {p.parent.name for p in (pool.pool_dir(settings) / "slots").glob("*/ready")} - but
        if len(found) >= n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"the keeper made no {n} ready sandbox(es)")


def test_keeper_refills_after_a_claim_and_drains_on_stop(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    """``launcher serve``'s keeper: fills the pool of a default task's shape, refills it
    after a launch took the one ready sandbox, and its stop drains the pool."""
    _, settings = pooled
    settings = settings.model_copy(update={"image": default_image})
    keeper = start_pool(settings)
    assert keeper is not None
    try:
        (first,) = _wait_ready(settings, 1)
        podman_boxes.track(first)
        spec = pool_template(settings).replace(
            name=f"agentbox-pool-keep-{os.getpid()}",
            workspace=make_workspace(),
            gateway_dir=None,
            deadline=60,
        )
        # the keeper's shape has a gateway dir: a spec without one is not served by it
        assert not pool.claim(keeper.backend, spec, ["true"], log_path=tmp_path / "x.log")
        gw = tmp_path / "gw"
        gw.mkdir(mode=0o755)
        spec = spec.replace(gateway_dir=gw)
        ended, out, _ = _run(
            podman_boxes, keeper.backend, spec, ["echo", "pooled"], tmp_path / "t.log"
        )
        assert ended == Exited(0, False) and out == b"pooled\n"
        assert first not in _containers(pool.SLOT_PREFIX)  # it served the task
        (second,) = _wait_ready(settings, 1, but=frozenset({first}))
        podman_boxes.track(second)
    finally:
        drained = keeper.stop()
    assert second in drained
    assert not pool_left(settings) and not pool_mounted(settings)


def test_escape_probes_pooled_as_fresh(
    pooled: tuple[PodmanBackend, Settings], default_image: str, podman_boxes: SandboxTracker
) -> None:
    """The escape suite's inside probes as the sandbox's main command (the agent's own
    path), on a pooled sandbox of the suite's spec (workspace, gateway dir, a read-only
    declared mount, small limits): none fails, and each has the outcome it has on a
    fresh sandbox run beside it (the control)."""
    backend, settings = pooled
    with Fixture(uid=settings.sandbox_host_uid) as fx:
        spec = real_spec(fx, settings, default_image, "runc", "standard")
        cfg = fx.probe_config(
            uid=spec.uid, pids_max=spec.resources.pids, runtime="runc", own_kernel=False
        )
        cfg["disk"] = spec.resources.disk_limit(settings).model_dump()
        env = {"ABX_PROBE_CONFIG": json.dumps(cfg)}
        argv = ["python3", "-I", "-S", "-c", probe_source()]
        [slot] = _fill(podman_boxes, backend, spec, 1)
        log = fx.root / "pooled.log"
        ended, out, err = _run(
            podman_boxes, backend, spec.replace(name=spec.name + "-p", env=env), argv, log
        )
        assert not _containers(slot)  # the probes ran in the pooled sandbox
        pooled_out = {o.id: o for o in inside_outcomes(_parse_json(out, f"pooled {ended} {err!r}"))}
        # The pooled sandbox ran in a uid range of its own, and the workspace followed it
        # there (a task's workspace never serves another sandbox): give it back.
        chown_tree(fx.workspace, settings.sandbox_host_uid, settings.sandbox_host_uid)
        podman_boxes.track(spec.name + "-f")
        fresh = backend.run(spec.replace(name=spec.name + "-f", env=env), argv)
        fresh_out = {o.id: o for o in inside_outcomes(_parse_json(fresh.stdout, "fresh"))}
    assert len(pooled_out) >= 10, pooled_out  # the suite's probes ran, not none
    assert sorted(pooled_out) == sorted(fresh_out)
    assert not [o for o in pooled_out.values() if o.status == "fail"], pooled_out
    assert {i: o.status for i, o in pooled_out.items()} == {
        i: o.status for i, o in fresh_out.items()
    }


def test_a_claim_returns_before_its_rename(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace,
    tmp_path: Path,
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim's ``podman rename`` is off the task's path (``_removals``): the task's
    command runs and the claim returns while it is held back; a kill by the task's name
    waits for it, then ends the task; the follower removes the renamed container."""
    backend, _ = pooled
    ws = make_workspace()
    slot = _fill(podman_boxes, backend, _template(default_image, ws), 1)[0]
    gate = threading.Event()
    real = removals.rename_later

    def gated(name: str, cid: str, rename: Callable[[], object]) -> None:
        real(name, cid, lambda: (gate.wait(120), rename()))

    monkeypatch.setattr(removals, "rename_later", gated)
    spec = _template(default_image, ws).replace(name=f"agentbox-poolrn-{os.getpid()}")
    podman_boxes.track(spec.name)
    log = tmp_path / "sandbox.log"
    try:
        backend.launch(spec, ["sh", "-c", "echo up; exec sleep 300"], log=log)
        end = time.monotonic() + 60  # a bound for a hang, not a speed target
        while b"up" not in (log.read_bytes() if log.exists() else b""):
            assert time.monotonic() < end, "the task's command did not run before the rename"
            time.sleep(0.05)
        assert _containers(slot) == [slot] and not _containers(spec.name), "renamed already"
        threading.Timer(1.0, gate.set).start()
        assert backend.kill(spec.name) == [spec.name], "the kill did not wait for the rename"
        assert gate.is_set()
        ended = backend.follow(spec.name, log=log, on_stdout=None, on_stderr=None, poll=0.05)
        assert ended.exit_code == 137
    finally:
        gate.set()
    assert removals.wait(spec.name, 120)
    assert not _containers(spec.name) and not _containers(slot)
