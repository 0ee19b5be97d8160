"""A killed or timed-out sandbox leaves nothing behind: no container, no conmon, no mount,
no process. Checked from the host: podman's list, psutil over every process's command line,
and /proc/self/mountinfo (the container's id names its storage and shm mounts); and, as
for every backend test, by the leak guard (``sandbox_factory``: cgroups, sockets, env fds)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.podman

RUNTIMES = [rt for rt in ("runc", "runsc") if _host.podman_runtime(rt).ok]
Factory = Callable[[PodmanBackend, Settings], SandboxTracker]


def _leftovers(name: str, short_id: str) -> list[str]:
    found = []
    ps = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found += [f"container {n}" for n in ps]
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if (name in cmd or short_id in cmd) and p.info["pid"] != psutil.Process().pid:
            found.append(f"process {p.info['pid']}: {cmd[:120]}")
    found += [
        f"mount {line.split()[4]}"
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if short_id in line
    ]
    return found


def _assert_gone(name: str, short_id: str) -> None:
    assert len(short_id) == 12 and all(c in "0123456789abcdef" for c in short_id), short_id
    deadline = time.monotonic() + 10
    while (left := _leftovers(name, short_id)) and time.monotonic() < deadline:
        time.sleep(0.2)  # conmon exits just after the container; give it a moment
    assert left == [], left


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_run_past_its_deadline_leaves_nothing(
    sandbox_settings: Settings, podman_boxes: SandboxTracker, default_image: str, runtime: str
) -> None:
    spec = spec_from_boxfile(Boxfile(runtime=runtime, deadline=2), sandbox_settings)
    seen: list[bytes] = []
    # The container's hostname is its short id; print it, then outlive the deadline.
    res = podman_boxes.run(
        spec, ["sh", "-c", "cat /etc/hostname; exec sleep 60"], on_stdout=seen.append
    )
    assert res.timed_out
    _assert_gone(spec.name, b"".join(seen).decode().strip())


def test_run_killed_from_inside_leaves_nothing(
    sandbox_settings: Settings, podman_boxes: SandboxTracker, default_image: str
) -> None:
    spec = spec_from_boxfile(Boxfile(), sandbox_settings)
    res = podman_boxes.run(spec, ["sh", "-c", "cat /etc/hostname; kill -9 $$"])
    assert res.exit_code == 137 and not res.timed_out
    _assert_gone(spec.name, res.stdout.decode().strip())


def test_sandbox_past_its_deadline_is_destroyed(
    sandbox_settings: Settings, podman_boxes: SandboxTracker, default_image: str
) -> None:
    spec = spec_from_boxfile(Boxfile(deadline=2), sandbox_settings)
    box = podman_boxes.create(spec)
    short_id = box.exec(["cat", "/etc/hostname"]).stdout.decode().strip()
    time.sleep(3)
    assert box.expired
    _assert_gone(spec.name, short_id)
    box.destroy()  # idempotent after the watchdog did it


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_killed_sandbox_is_destroyed_with_nothing_left(
    sandbox_settings: Settings, podman_boxes: SandboxTracker, default_image: str, runtime: str
) -> None:
    spec = spec_from_boxfile(Boxfile(runtime=runtime), sandbox_settings)
    box = podman_boxes.create(spec)
    short_id = box.exec(["cat", "/etc/hostname"]).stdout.decode().strip()
    live = _leftovers(spec.name, short_id)  # the check can see a live sandbox
    assert any(x.startswith("container") for x in live), live
    assert any(x.startswith("process") for x in live), live
    subprocess.run(["podman", "kill", "--signal", "KILL", spec.name], check=True)
    box.destroy()
    _assert_gone(spec.name, short_id)


def test_an_oom_kill_leaves_nothing_in_the_callers_cwd(
    default_image: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_factory: Factory,
) -> None:
    """conmon drops an ``oom`` marker into its cwd after an OOM kill under ``--rm``;
    the backend runs podman in a private dir, so the caller's cwd stays clean."""
    from agentbox.backends.base import SandboxSpec
    from agentbox.boxfile import Resources

    settings = Settings(data_dir=tmp_path / "data")
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    spec = SandboxSpec(
        name=f"agentbox-oom-{os.getpid()}",
        image=Settings().image,
        resources=Resources(memory="64MiB", cpus=1),  # type: ignore[arg-type]
        deadline=60,
    )
    code = (
        "import subprocess; "
        "r = subprocess.run(['python3', '-c', 'x = bytearray(1 << 28)']); print(r.returncode)"
    )
    res = sandbox_factory(PodmanBackend(settings), settings).run(spec, ["python3", "-c", code])
    assert res.stdout.strip() == b"-9"  # the child was OOM-killed, its parent survived
    assert list(caller.iterdir()) == []
    assert list((settings.data_dir / "run").iterdir()) == []


def test_an_oom_kill_in_a_long_lived_sandbox_leaves_the_cwd_clean(
    default_image: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_factory: Factory,
) -> None:
    """The same for ``create`` + ``exec``: conmon runs from our private dir."""
    from agentbox.backends.base import SandboxSpec
    from agentbox.boxfile import Resources

    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    spec = SandboxSpec(
        name=f"agentbox-oom2-{os.getpid()}",
        image=Settings().image,
        resources=Resources(memory="64MiB", cpus=1),  # type: ignore[arg-type]
        deadline=60,
    )
    settings = Settings(data_dir=tmp_path / "data")
    with sandbox_factory(PodmanBackend(settings), settings).create(spec) as box:
        res = box.exec(["python3", "-c", "x = bytearray(1 << 28)"])
    assert res.exit_code == 137  # OOM-killed
    assert list(caller.iterdir()) == []
