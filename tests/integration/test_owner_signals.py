"""Killing the client never leaves its sandbox running (issue 18, item 4).

The real CLI runs as a subprocess (``agentbox exec``, ``agentbox shell``,
``agentbox run``) on every backend present; once its sandbox is up, the test
sends one signal to the client's pid alone, as CI timeouts, systemd, a closed
terminal or the OOM killer would. A caught signal (TERM, HUP, INT) must destroy
the sandbox before the client ends; SIGKILL cannot be caught, so the owner's
watchdog must reap it without waiting for a launcher to start. Either way the
container or VM must be gone within a bounded wait (polled; no speed asserted).
Each client's sandbox, once up, is registered by name with the leak guard
(:class:`~sandbox_leaks.SandboxTracker`): after the test nothing naming it may remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends.base import LABEL, Backend
from agentbox.config import Settings
from agentbox.core import host as _host
from git_helpers import git
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes are made as root")

ROOT = Path(__file__).resolve().parents[2]
SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL]
#: Bounded waits (seconds): a sandbox that is not gone by then was left behind.
GONE_WITHIN = 120.0
UP_WITHIN = 240.0


def _backends() -> list[Any]:
    out: list[Any] = []
    for rt in ("runc", "runsc"):
        ok = _host.podman_runtime(rt).ok
        out.append(
            pytest.param(
                ("podman", rt),
                id=rt,
                marks=[
                    pytest.mark.podman,
                    pytest.mark.skipif(not ok, reason=f"podman runtime {rt} not usable here"),
                ],
            )
        )
    out.append(pytest.param(("qemu", None), id="qemu", marks=pytest.mark.qemu))
    return out


BACKENDS = _backends()


def _cases() -> list[object]:
    """Every backend with every signal, but qemu only with SIGTERM (the graceful path,
    which SIGHUP and SIGINT share in the client) and SIGKILL: under TCG each case boots a
    VM for a minute, and what differs by signal is the client's code, run on podman."""
    out: list[object] = []
    for b in BACKENDS:
        for sig in SIGNALS:
            if b.id == "qemu" and sig not in (signal.SIGTERM, signal.SIGKILL):
                continue
            out.append(pytest.param(b.values[0], sig, id=f"{b.id}-{sig.name}", marks=b.marks))
    return out


CASES = _cases()


@dataclass
class World:
    base: Path
    env: dict[str, str]
    settings: Settings
    factory: Callable[[Backend, Settings], SandboxTracker]
    clients: list[subprocess.Popen[bytes]] = field(default_factory=list)
    trackers: dict[str, SandboxTracker] = field(default_factory=dict)

    def track(self, backend: str, names: Iterable[str]) -> None:
        """Register the client's sandboxes with the leak guard (checked after the test)."""
        from agentbox.backends import get_backend

        if backend not in self.trackers:
            be = get_backend(backend, self.settings)
            self.trackers[backend] = self.factory(be, self.settings)
        for name in names:
            self.trackers[backend].track(name)


@pytest.fixture
def world(
    default_image: str, sandbox_factory: Callable[[Backend, Settings], SandboxTracker]
) -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-sig-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
        (base / sub).chmod(0o711)
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    world = World(base, env, Settings(data_dir=base / "data"), sandbox_factory)
    try:
        yield world
    finally:
        # A test that failed before its signal leaves its client running: TERM lets
        # it clean up (the feature under test), KILL if it does not.
        for proc in world.clients:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(GONE_WITHIN)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        with contextlib.suppress(AssertionError):
            _poll(lambda: not _watchdogs(world), GONE_WITHIN, "")
        try:
            assert_no_mounts_under(base)  # no workspace disk, no settle mount (issue 19)
        finally:
            shutil.rmtree(base, ignore_errors=True)


# -- finding the client's sandbox, from the host ------------------------------


def _containers(owner: int) -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label=io.agentbox.owner-pid={owner}",
         "--format", "{{.Names}}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()


def _vms(data_dir: Path, owner: int) -> list[str]:
    """VM dirs the client made (its pid in their owner file), and VMs whose VMM lives."""
    found = []
    for d in (data_dir / "microvm").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            if json.loads((d / "owner").read_text()).get("pid") == owner:
                found.append(d.name)
    return found


def _sandbox_names(backend: str, world: World, owner: int) -> list[str]:
    """The names of the client's sandboxes (a microVM's from its owner file)."""
    if backend == "podman":
        return _containers(owner)
    names = []
    for d in (world.settings.data_dir / "microvm").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            rec = json.loads((d / "owner").read_text())
            if rec.get("pid") == owner and isinstance(rec.get(LABEL), str):
                names.append(rec[LABEL])
    from agentbox.backends.microvm.qemu import _records

    recs = (world.settings.data_dir / _records.RECORD_DIR).glob("*.json")
    return names + sorted(p.stem for p in recs)


def _vmm_alive(vm: str) -> bool:
    from agentbox.backends.microvm._firecracker import cgroup_dirs

    for d in cgroup_dirs(vm):
        with contextlib.suppress(OSError):
            if (d / "cgroup.procs").read_text().split():
                return True
    return False


def _sandboxes(backend: str, world: World, owner: int) -> list[str]:
    if backend == "podman":
        return _containers(owner)
    # A launcher task's microVM runs detached: its monitor owns it (a sealed record).
    from agentbox.backends.microvm.qemu import _records

    recs = (world.settings.data_dir / _records.RECORD_DIR).glob("*.json")
    return _vms(world.settings.data_dir, owner) + sorted(p.stem for p in recs)


def _poll(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.25)


def _cleanup(backend: str, world: World, owner: int, vms: list[str]) -> None:
    from agentbox.backends import get_backend

    be = get_backend(backend, world.settings)
    for name in _containers(owner) if backend == "podman" else []:
        be.kill(name)
    for vm in vms:
        from agentbox.backends.microvm._firecracker import cgroup_dirs
        from agentbox.backends.microvm._jail import Cgroup

        cg = Cgroup.__new__(Cgroup)
        cg.name, cg.dirs = vm, cgroup_dirs(vm)
        cg.remove()
        shutil.rmtree(world.settings.data_dir / "microvm" / vm, ignore_errors=True)


def _signal_and_check(
    proc: subprocess.Popen[bytes], sig: signal.Signals, backend: str, world: World
) -> None:
    """Send ``sig`` to the client alone; its sandbox must be gone, and the client too."""
    owner = proc.pid
    up = _sandboxes(backend, world, owner)
    assert up, "the sandbox is not up"
    world.track(backend, _sandbox_names(backend, world, owner))
    vms = up if backend == "qemu" else []
    try:
        os.kill(owner, sig)
        if sig != signal.SIGKILL:
            # A caught signal: the client destroys the sandbox, then ends by that signal.
            proc.wait(GONE_WITHIN)
        else:
            proc.wait(30)
        _poll(
            lambda: not _sandboxes(backend, world, owner) and not any(map(_vmm_alive, vms)),
            GONE_WITHIN,
            f"{backend}: the sandbox outlived its client ({sig.name}): "
            f"{_sandboxes(backend, world, owner)}; watchdog log: {_wd_log(world)}",
        )
        # Nothing of the client is left either: its watchdog has finished and exited.
        _poll(lambda: not _watchdogs(world), GONE_WITHIN, "the watchdog never exited")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _cleanup(backend, world, owner, vms)


def _watchdogs(world: World) -> list[int]:
    """Live watchdog processes of this data dir."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or not _alive(int(d.name)):
            continue
        with contextlib.suppress(OSError):
            args = (d / "cmdline").read_bytes().split(b"\0")
            if (
                any(b"_watchdog" in a for a in args)
                and str(world.settings.data_dir).encode() in args
            ):
                found.append(int(d.name))
    return found


def _wd_log(world: World) -> str:
    logs = [world.settings.data_dir / "run" / "watchdog.log"]
    logs += list((world.settings.data_dir / "tasks").glob("*/logs/watchdog.log"))
    return " | ".join(p.read_text()[-600:] for p in logs if p.exists())


def _wait_line(proc: subprocess.Popen[bytes], marker: bytes) -> None:
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""
    end = time.monotonic() + UP_WITHIN
    while marker not in seen:
        assert proc.poll() is None, f"the client exited: {seen!r}"
        assert time.monotonic() < end, f"no {marker!r} from the sandbox: {seen!r}"
        with contextlib.suppress(BlockingIOError, TypeError):
            seen += proc.stdout.read(4096) or b""
        time.sleep(0.1)


def _default_signals() -> None:
    """In the client before exec: INT and QUIT as a shell's foreground job has them. A
    suite started in the background (a non-interactive ``cmd &``, as a CI runner may)
    ignores both, and an ignored signal stays ignored across exec: the client would
    then rightly keep running (``exit_on_signals`` leaves an ignored signal ignored)."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _cli(args: list[str], world: World) -> subprocess.Popen[bytes]:
    # Its own session: the signal reaches the client alone, never the test.
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=world.env, start_new_session=True, preexec_fn=_default_signals,
    )  # fmt: skip
    world.clients.append(proc)
    return proc


def _backend_args(backend: tuple[str, str | None]) -> list[str]:
    name, runtime = backend
    return ["--backend", name] + (["--runtime", runtime] if runtime else [])


LONG = ["sh", "-c", "echo sandbox-up; exec sleep 300"]


@pytest.mark.parametrize(("backend", "sig"), CASES)
def test_exec_client_killed_leaves_no_sandbox(
    world: World, backend: tuple[str, str | None], sig: signal.Signals
) -> None:
    proc = _cli(["exec", *_backend_args(backend), "--", *LONG], world)
    _wait_line(proc, b"sandbox-up")
    _signal_and_check(proc, sig, backend[0], world)
    if sig != signal.SIGKILL:
        assert proc.returncode == -sig, "the client should end by the signal it got"
    assert not list((world.settings.data_dir / "scratch").glob("ws-*")), "scratch left"


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shell_client_killed_leaves_no_sandbox(
    world: World, backend: tuple[str, str | None], sig: signal.Signals
) -> None:
    if backend[0] == "qemu":
        pytest.skip("the qemu backend has no interactive shell (agentbox shell refuses it)")
    proc = _cli(["shell", *_backend_args(backend), "--", *LONG], world)
    _wait_line(proc, b"sandbox-up")
    _signal_and_check(proc, sig, backend[0], world)


SLOW_SCRIPT = """\
name: slow
turns:
  - tool_use:
      - name: Bash
        input:
          command: "echo started > /workspace/started.txt; sleep 300"
          description: "A long command"
          timeout: 600000
  - text: "Done."
"""


@pytest.mark.claude
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "sig"), CASES)
def test_run_client_killed_leaves_no_sandbox(
    world: World, backend: tuple[str, str | None], sig: signal.Signals
) -> None:
    """``agentbox run`` is the launcher itself: its sandbox and gateway must go."""
    name, runtime = backend
    (world.base / "slow.yaml").write_text(SLOW_SCRIPT)
    (world.base / "models.toml").write_text(
        '[models.replay-slow]\nkind = "replay"\nupstream = "slow.yaml"\n'
    )
    repo = world.base / "repos" / "proj"
    shutil.copytree(ROOT / "demo" / "sample-repo", repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "s")
    box = world.base / "Boxfile.toml"
    box.write_text(f'backend = "{name}"\n' + (f'runtime = "{runtime}"\n' if runtime else ""))
    # One id per backend and signal: a sandbox left by a failed case never meets the next.
    task_id = f"sig-{name}-{runtime or 'vm'}-{sig.name.lower()}"
    proc = _cli(
        ["run", "wait", "--repo", str(repo), "--model", "replay-slow", "--deadline", "600",
         "--boxfile", str(box), "--id", task_id, "--no-publish", "--json"],
        world,
    )  # fmt: skip
    started = world.settings.data_dir / "tasks" / task_id / "workspace" / "started.txt"
    end = time.monotonic() + UP_WITHIN
    # Up: the agent is inside its long command (for qemu the file is on the VM's disk,
    # so wait for the sandbox and the second model request instead).
    while not (started.exists() or _in_long_command(world, task_id)):
        if proc.poll() is not None:
            log = world.settings.data_dir / "tasks" / task_id / "logs" / "launcher.log"
            text = log.read_text() if log.exists() else ""
            if "runsc's gofer" in text:
                # The launcher makes <data_dir>/tasks 0700 (0710 with a share group),
                # which runsc's gofer (host uid 100000) cannot traverse: runsc tasks
                # are refused before any sandbox starts, so there is none to kill.
                pytest.skip("launcher tasks cannot start on runsc here: " + text[-300:])
            raise AssertionError(f"the client exited early: {text[-600:]}")
        assert time.monotonic() < end, "the agent never got to its long command"
        time.sleep(0.5)
    gateways = _task_gateways(world, task_id)
    world.track(name, [f"agentbox-task-{task_id}"])
    try:
        if sig == signal.SIGKILL and _detaches(world, name, runtime):
            # Live restore (issue 19): a task's detached sandbox and its gateway outlive a
            # launcher killed outright; the next launcher re-adopts it. Here: one does, and
            # a cancel through it leaves nothing.
            _killed_run_is_readopted(proc, world, name, task_id)
            return
        _signal_and_check(proc, sig, name, world)
        _poll(
            lambda: not any(_alive(pid) for pid in gateways),
            GONE_WITHIN,
            f"the task's gateway outlived its client ({sig.name})",
        )
    finally:
        for pid in gateways:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _detaches(world: World, name: str, runtime: str | None) -> bool:
    from agentbox.backends import get_backend

    return get_backend(name, world.settings).detaches(runtime or "runc")


def _killed_run_is_readopted(
    proc: subprocess.Popen[bytes], world: World, name: str, task_id: str
) -> None:
    from agentbox.launcher import Launcher

    owner = proc.pid
    assert _sandboxes(name, world, owner), "the sandbox is not up"
    os.kill(owner, signal.SIGKILL)
    proc.wait(30)
    time.sleep(2.0)
    assert _sandboxes(name, world, owner), "a killed launcher's detached sandbox did not live on"
    settings = Settings(
        data_dir=world.settings.data_dir,
        repos_root=world.base / "repos",
        models_file=world.base / "models.toml",
    )
    launcher = Launcher(settings)
    try:
        assert task_id in launcher.reconcile(), "the next launcher did not take the task over"
        launcher.cancel(task_id)
        info = launcher.wait(task_id, timeout=GONE_WITHIN)
        assert info.status == "cancelled", info
    finally:
        launcher.close()
    log = (world.settings.data_dir / "tasks" / task_id / "logs" / "launcher.log").read_text()
    assert "re-adopted by launcher pid" in log, log[-2000:]
    _poll(lambda: not _sandboxes(name, world, owner), GONE_WITHIN, "the sandbox outlived its end")
    # Its workspace disk is settled by its follower or, where the container went first (CI:
    # once in three runs a mount was left here), by the next launcher's start, which
    # settles every disk whose owner and container are gone: be that start.
    from agentbox.backends import settle_dead_disks

    settle_dead_disks(settings)


def _in_long_command(world: World, task_id: str) -> bool:
    from agentbox.core.paths import TaskPaths
    from agentbox.gateway import read_usage

    try:
        return read_usage(TaskPaths(world.settings.data_dir, task_id).usage_file).requests >= 1
    except Exception:
        return False


def _task_gateways(world: World, task_id: str) -> list[int]:
    from agentbox.launcher._names import list_task_gateways

    return [o.pid for t, o in list_task_gateways(world.settings) if t == task_id]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
