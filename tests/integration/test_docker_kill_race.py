"""A docker sandbox's bind points against a kill that races its launch, on a real Engine.

A launch first prepares the hardened bind points of its mounts (``_binds.py``), then
creates the container on them. A cancel's kill (repeated by the launcher's monitor)
can come in between: with no container to remove, it must release nothing, or the
launch goes on with its binds gone under it. ``reap`` (owner dead: no launch in
progress) still releases them, container or not; a start that fails releases its own.

Every sandbox goes through ``sandbox_factory``; the bind points are checked by hand
(``HostBinds.leftovers``): the leak guard does not look at them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_docker_backend

from agentbox.backends import get_backend
from agentbox.backends.base import SandboxSpec
from agentbox.backends.docker import DockerBackend
from agentbox.backends.docker._binds import HostBinds
from agentbox.config import Settings
from agentbox.errors import SandboxError
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.docker

WAIT = 120.0  # a bound on every wait, so a broken launch fails the test, never hangs it


backend = test_docker_backend.backend  # a docker backend on its own data dir, closed after


@pytest.fixture
def boxes(
    backend: DockerBackend, sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker]
) -> SandboxTracker:
    return sandbox_factory(backend, backend.settings)


def _spec(be: DockerBackend, name: str, ws: Path) -> SandboxSpec:
    return SandboxSpec(name=name, image=be.settings.image, workspace=ws)


def test_a_kill_during_the_launch_leaves_its_binds(
    backend: DockerBackend,
    boxes: SandboxTracker,
    workspace_factory: Callable[[Settings], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launch is held between its bind set-up and its container create while
    another backend (as the launcher's ``kill_sandbox`` makes one) kills the name."""
    ws = workspace_factory(backend.settings)
    spec = _spec(backend, f"dk-race-{os.getpid()}", ws)
    binds = HostBinds(backend.settings, spec.name)
    api = backend.client.api
    create = api.create_container_from_config
    held, go = threading.Event(), threading.Event()

    def paused_create(*args: Any, **kw: Any) -> Any:
        held.set()
        go.wait(WAIT)
        return create(*args, **kw)

    monkeypatch.setattr(api, "create_container_from_config", paused_create)
    made: list[Any] = []

    def launch() -> None:
        try:
            made.append(boxes.create(spec))
        except BaseException as exc:
            made.append(exc)

    launcher = threading.Thread(target=launch, name="dk-race-launch")
    launcher.start()
    killer = get_backend("docker", Settings(data_dir=backend.settings.data_dir))
    assert isinstance(killer, DockerBackend)
    try:
        assert held.wait(WAIT), "the launch never reached its container create"
        assert binds.leftovers(), "the launch prepared no bind point"
        found = killer.kill(spec.name)
        assert binds.leftovers(), "the kill released the bind points under the launch"
        assert found == []  # no container: nothing killed, nothing released
    finally:
        go.set()
        launcher.join(WAIT)
        killer.client.close()
    assert not launcher.is_alive()
    assert made and not isinstance(made[0], BaseException), made
    with made[0] as box:
        assert box.exec(["sh", "-c", "echo ran > /workspace/out"]).exit_code == 0
    assert (ws / "out").read_text() == "ran\n"  # the workspace was bound, and written
    assert binds.leftovers() == []  # the owner's destroy released them
    boxes.assert_clean()


def test_reap_without_a_container_releases_the_binds(
    backend: DockerBackend, workspace_factory: Callable[[Settings], Path]
) -> None:
    """A dead owner's bind points, prepared as a launch does, no container made yet."""
    name = f"dk-reap-{os.getpid()}"
    binds = HostBinds(backend.settings, name)
    try:
        binds.add(workspace_factory(backend.settings), read_only=False)
        assert binds.leftovers()
        backend.reap(name)
        assert binds.leftovers() == []
    finally:
        binds.release()


def test_a_failed_start_releases_its_binds(
    backend: DockerBackend,
    boxes: SandboxTracker,
    workspace_factory: Callable[[Settings], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The container is created, the Engine refuses to start it: the container and its
    bind points go (a kill, which used to release them, may never come)."""
    spec = _spec(backend, f"dk-nostart-{os.getpid()}", workspace_factory(backend.settings))
    api = backend.client.api

    def refused(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("start refused (the test's)")

    monkeypatch.setattr(api, "start", refused)
    binds = HostBinds(backend.settings, spec.name)
    try:
        with pytest.raises(SandboxError, match="could not start it"):
            boxes.create(spec)
        assert binds.leftovers() == []
    finally:
        binds.release_all()  # the leak the test is about: not left for the next
    boxes.assert_clean()


def test_a_setup_cancelled_before_its_container_is_still_killed(
    backend: DockerBackend,
    boxes: SandboxTracker,
    workspace_factory: Callable[[Settings], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The setup phase's cancel watcher (``env/_phase.py``) on a real run: its first
    kill lands before the container exists (the create is held until it returned),
    so it finds nothing; it must kill again, not leave the run to its deadline."""
    from agentbox.env._phase import _watch

    name = f"dk-setup-{os.getpid()}"
    spec = SandboxSpec(name=name, image=backend.settings.image,
                       workspace=workspace_factory(backend.settings), deadline=20)  # fmt: skip
    api = backend.client.api
    create = api.create_container_from_config
    killed_once = threading.Event()

    def held_create(*args: Any, **kw: Any) -> Any:
        killed_once.wait(WAIT)
        return create(*args, **kw)

    monkeypatch.setattr(api, "create_container_from_config", held_create)
    killer = get_backend("docker", Settings(data_dir=backend.settings.data_dir))
    assert isinstance(killer, DockerBackend)
    found: list[list[str]] = []

    def kill() -> None:
        found.append(killer.kill(name))
        killed_once.set()

    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(lambda: True, done, kill))
    watcher.start()
    try:
        res = boxes.run(spec, ["sleep", "600"])
        assert not res.timed_out, "the run was left to its deadline after the cancel"
        assert res.exit_code != 0
    except SandboxError as exc:  # the kill came between its create and its start
        assert "could not start it" in str(exc), exc
    finally:
        done.set()
        watcher.join(WAIT)
        killer.client.close()
    assert found[0] == []  # the first kill: no container yet
    assert [name] in found  # a later one found it and removed it
    assert HostBinds(backend.settings, name).leftovers() == []
    boxes.assert_clean()
