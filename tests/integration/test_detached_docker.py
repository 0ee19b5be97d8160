"""Detached docker sandboxes (issue 32) with the real Engine: launched, followed from any
process, checked before they are touched (labels, data dir, seal), and nothing left.

The launcher's use of them (killed at random, re-adopted; the deadline with no launcher;
a dockerd restart) is ``tests/e2e/test_live_restore.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends._k8slog import read_exit
from agentbox.backends.base import LABEL, OWNER_DATA_LABEL, SandboxSpec, data_dir_label
from agentbox.backends.docker import DockerBackend
from agentbox.backends.docker import _detach as detach
from agentbox.backends.docker._image import ensure_image
from agentbox.config import Settings
from agentbox.errors import SandboxError, SandboxGone
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="bind points and workspace disks need root"),
]


@pytest.fixture
def names(
    sandbox_settings: Settings,
    sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker],
) -> Iterator[list[str]]:
    """Names to reap whatever the test's outcome; the leak guard checks them after."""
    backend = DockerBackend(sandbox_settings)
    tracker = sandbox_factory(backend, sandbox_settings)
    got: list[str] = []
    yield got
    for name in got:
        tracker.track(name)
        with contextlib.suppress(Exception):
            backend.reap(name)
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def _follow(backend: DockerBackend, name: str, log: Path) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    ended = backend.follow(name, log=log, on_stdout=out.append, on_stderr=err.append)
    return ended, b"".join(out), b"".join(err)


def _exists(name: str) -> bool:
    return (
        subprocess.run(["docker", "container", "inspect", name], capture_output=True).returncode
        == 0
    )


def test_launched_then_followed_twice_the_second_replays_the_end(
    sandbox_settings: Settings, default_image: str, names: list[str], tmp_path: Path
) -> None:
    backend = DockerBackend(sandbox_settings)
    ws = sandbox_settings.data_dir / "ws"
    ws.mkdir()
    os.chown(ws, sandbox_settings.sandbox_host_uid, sandbox_settings.sandbox_host_uid)
    name = f"det-docker-{os.getpid()}"
    names.append(name)
    log = tmp_path / "sandbox.log"
    spec = SandboxSpec(name=name, image=default_image, workspace=ws, deadline=300,
                       labels={"io.agentbox.task": "t"})  # fmt: skip
    script = "echo out-1; echo err-1 >&2; echo made > /workspace/f.txt; printf tail; exit 3"
    backend.launch(spec, ["sh", "-c", script], log=log)
    assert backend.adoptable(name, labels={"io.agentbox.task": "t"})
    assert not backend.adoptable(name, labels={"io.agentbox.task": "other"})
    ended, out, err = _follow(backend, name, log)
    assert ended == Exited(3, False)
    assert out == b"out-1\ntail" and err == b"err-1\n"
    assert (ws / "f.txt").read_text() == "made\n"  # the workspace disk copied back
    assert not os.path.ismount(ws)
    assert not _exists(name)
    assert read_exit(log) == ended
    # A second follower (the first died after the end): the same end, the same output.
    again, out2, err2 = _follow(backend, name, log)
    assert (again, out2, err2) == (ended, out, err)
    binds = sandbox_settings.data_dir / "docker-binds" / name
    assert not binds.exists() or not any(binds.iterdir())


def test_adoptable_refuses_what_is_not_ours(
    sandbox_settings: Settings,
    settings_factory: Callable[[], Settings],
    default_image: str,
    names: list[str],
    tmp_path: Path,
) -> None:
    backend = DockerBackend(sandbox_settings)
    assert not backend.adoptable("det-no-such-sandbox", labels={})
    with pytest.raises(SandboxGone):
        backend.follow("det-no-such-sandbox", log=tmp_path / "none.log", on_stdout=None,
                       on_stderr=None)  # fmt: skip
    # Another data dir's sandbox, same name, same labels: refused, and left alone.
    other = settings_factory()
    name = f"det-docker-other-{os.getpid()}"
    names.append(name)
    spec = SandboxSpec(name=name, image=default_image, deadline=300,
                       labels={"io.agentbox.task": "t"})  # fmt: skip
    DockerBackend(other).launch(spec, ["sleep", "600"], log=tmp_path / "other.log")
    assert DockerBackend(other).adoptable(name, labels={"io.agentbox.task": "t"})
    assert not backend.adoptable(name, labels={"io.agentbox.task": "t"})
    with pytest.raises(SandboxGone):
        backend.follow(name, log=tmp_path / "x.log", on_stdout=None, on_stderr=None)
    assert _exists(name), "a refused follower must not touch it"
    DockerBackend(other).reap(name)
    # Made by hand with our labels and our data dir's label, but not by us (no seal).
    forged = f"det-docker-forged-{os.getpid()}"
    names.append(forged)
    labels = {
        LABEL: "1",
        OWNER_DATA_LABEL: data_dir_label(sandbox_settings.data_dir),
        detach.DETACHED_LABEL: "1",
        detach.DEADLINE_LABEL: "600",
        detach.SEAL_LABEL: "0" * 32,
    }
    image_id = ensure_image(backend.client, sandbox_settings, default_image)
    argv = ["docker", "create", "--name", forged, "--network", "none"]
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    subprocess.run([*argv, image_id, "sleep", "600"], check=True, capture_output=True)
    assert not backend.adoptable(forged, labels={})


def _killed_at_the_cap(backend: DockerBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's init dies just as its user namespace is capped (CI, stop 37: a
    chaos run met it), by a ``docker kill`` before the real cap runs."""
    real = backend._cap_pid

    def cap(pid: int, name: str) -> None:
        subprocess.run(["docker", "kill", name], capture_output=True, check=True)
        subprocess.run(["docker", "wait", name], capture_output=True, timeout=60)
        real(pid, name)

    monkeypatch.setattr(backend, "_cap_pid", cap)


def _capkill_case(
    settings: Settings, image: str, names: list[str], what: str
) -> tuple[DockerBackend, str, SandboxSpec]:
    """A backend, a sandbox name (reaped after the test) and a spec for a cap-kill case."""
    name = f"det-docker-capkill-{what}-{os.getpid()}"
    names.append(name)
    spec = SandboxSpec(name=name, image=image, deadline=300, labels={"io.agentbox.task": "t"})
    return DockerBackend(settings), name, spec


def test_a_container_killed_at_its_cap_fails_the_launch_saying_so(
    sandbox_settings: Settings,
    default_image: str,
    names: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, name, spec = _capkill_case(sandbox_settings, default_image, names, "l")
    _killed_at_the_cap(backend, monkeypatch)
    with pytest.raises(SandboxError, match="ended before its command started"):
        backend.launch(spec, ["sh", "-c", "echo ran > /tmp/x"], log=tmp_path / "s.log")
    assert not _exists(name)


def test_a_follower_reads_a_container_killed_at_its_cap_as_its_end(
    sandbox_settings: Settings,
    default_image: str,
    names: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, name, spec = _capkill_case(sandbox_settings, default_image, names, "f")
    log = tmp_path / "s.log"
    # Its launcher died after the start, before the cap and the gate.
    with monkeypatch.context() as m:
        m.setattr(backend, "_cap_pid", lambda pid, name: None)
        m.setattr(detach, "_open_gate", lambda *a: None)
        backend.launch(spec, ["sh", "-c", "echo ran"], log=log)
    assert _exists(name)
    _killed_at_the_cap(backend, monkeypatch)
    ended, out, _ = _follow(backend, name, log)
    assert ended.exit_code != 0 and out == b"", "the command behind the gate never ran"
    assert not _exists(name)
    assert read_exit(log) == ended
