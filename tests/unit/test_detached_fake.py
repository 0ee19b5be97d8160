"""Detached sandboxes on the in-process FakeBackend: launch, adopt from a second
backend on the same data dir (a launcher restart), follow, and refuse the rest.

The same contract the podman backend passes for real in
``tests/integration/test_detached_podman.py``; here in milliseconds, so the
launcher's re-adoption logic above it can be tested the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends import Exited, get_backend
from agentbox.backends.base import SandboxSpec
from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.config import Settings
from agentbox.errors import SandboxGone, UnsupportedError


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    FakeBackend.reset()
    yield
    FakeBackend.reset()


def _spec(ws: Path, name: str = "t1", **kw: object) -> SandboxSpec:
    return SandboxSpec(name=name, image="x", workspace=ws, **kw)  # type: ignore[arg-type]


def _follow(backend: FakeBackend, name: str, log: Path) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    ended = backend.follow(name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.01)
    return ended, b"".join(out), b"".join(err)


def test_a_second_backend_on_the_same_data_dir_adopts_and_follows(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    log = tmp_path / "sandbox.log"
    release = threading.Event()
    script = FakeScript(
        exit_code=3,
        stdout=b"one\ntwo",
        stderr=b"\xff\xfe not utf-8\n",
        files={"out.txt": b"done\n"},
        action=lambda box, argv: release.wait(5),
    )
    first = FakeBackend(Settings(data_dir=tmp_path / "data"))
    with FakeBackend.scripted(script):
        first.launch(_spec(ws, labels={"io.agentbox.task": "t1"}), ["claude"], log=log)
    assert first.detaches("runc")
    del first  # the launcher "dies"; the sandbox runs on

    again = FakeBackend(Settings(data_dir=tmp_path / "data"))
    assert again.owned() == ["t1"]
    assert again.adoptable("t1", labels={"io.agentbox.task": "t1"})
    assert not again.adoptable("t1", labels={"io.agentbox.task": "other"})
    release.set()
    ended, out, err = _follow(again, "t1", log)
    assert ended == Exited(3, False)
    assert (out, err) == (b"one\ntwo", b"\xff\xfe not utf-8\n")
    assert (ws / "out.txt").read_bytes() == b"done\n"
    # Followed to its end: removed; a follower that comes after replays the same end.
    assert FakeBackend.live("t1") is None
    assert not again.adoptable("t1", labels={})
    assert _follow(again, "t1", log) == (Exited(3, False), out, err)


def test_another_data_dir_and_unknown_names_are_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    log = tmp_path / "sandbox.log"
    mine = FakeBackend(Settings(data_dir=tmp_path / "a"))
    with FakeBackend.scripted(FakeScript(delay=30)):
        mine.launch(_spec(ws), ["claude"], log=log)
    other = FakeBackend(Settings(data_dir=tmp_path / "b"))
    assert not other.adoptable("t1", labels={})
    assert other.owned() == []
    with pytest.raises(SandboxGone):
        other.follow("t1", log=tmp_path / "other.log", on_stdout=None, on_stderr=None)
    with pytest.raises(SandboxGone):
        mine.follow("nope", log=tmp_path / "nope.log", on_stdout=None, on_stderr=None)
    mine.reap("t1")
    assert mine.owned() == []


def test_the_deadline_holds_with_nobody_following(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    log = tmp_path / "sandbox.log"
    backend = FakeBackend(Settings(data_dir=tmp_path / "data"))
    with FakeBackend.scripted(FakeScript(delay=3600)):
        backend.launch(_spec(ws, deadline=60.0), ["claude"], log=log)
    box = FakeBackend.live("t1")
    assert box is not None
    box.advance(61)  # the deadline passes while no launcher exists
    assert box.done.wait(5)
    assert _follow(backend, "t1", log)[0] == Exited(137, True)


def test_kill_ends_a_launched_sandbox_with_137(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    backend = FakeBackend(Settings(data_dir=tmp_path / "data"))
    with FakeBackend.scripted(FakeScript(delay=3600)):
        backend.launch(_spec(ws), ["claude"], log=tmp_path / "l")
    backend.kill("t1")
    assert _follow(backend, "t1", tmp_path / "l")[0] == Exited(137, False)


@pytest.mark.parametrize("name", ["firecracker"])
def test_backends_that_cannot_detach_say_so(name: str, tmp_path: Path) -> None:
    backend = get_backend(name, Settings(data_dir=tmp_path))
    assert backend.detaches("runc") is False
    with pytest.raises(UnsupportedError):
        backend.launch(_spec(tmp_path), ["true"], log=tmp_path / "l")
    with pytest.raises(UnsupportedError):
        backend.follow("x", log=tmp_path / "l", on_stdout=None, on_stderr=None)
    with pytest.raises(UnsupportedError):
        backend.adoptable("x", labels={})


def test_docker_detaches_now(tmp_path: Path) -> None:
    """Docker tasks run detached through the Engine (live restore on every backend)."""
    assert get_backend("docker", Settings(data_dir=tmp_path)).detaches("runc") is True
