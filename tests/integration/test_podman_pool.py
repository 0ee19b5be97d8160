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
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _pool as pool
from agentbox.config import Settings
from mount_helpers import assert_no_mounts_under

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and mounts need root"),
]


def _pooled(settings: Settings, size: int = 1) -> Settings:
    return settings.model_copy(update={"pool_size": size})


def _template(image: str, ws: Path, **kw: object) -> SandboxSpec:
    return SandboxSpec(name="template", image=image, workspace=ws, deadline=120, **kw)  # type: ignore[arg-type]


def _containers(prefix: str) -> list[str]:
    res = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, check=True
    )
    return [n for n in res.stdout.split() if n.startswith(prefix)]


def _run(
    backend: PodmanBackend, spec: SandboxSpec, argv: list[str], log: Path
) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    backend.launch(spec, argv, log=log)
    ended = backend.follow(
        spec.name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.05
    )
    return ended, b"".join(out), b"".join(err)


@pytest.fixture
def pooled(sandbox_settings: Settings) -> Iterator[tuple[PodmanBackend, Settings]]:
    """A backend whose settings turn the pool on; everything of the pool drained after."""
    settings = _pooled(sandbox_settings)
    backend = PodmanBackend(settings)
    names: list[str] = []
    yield backend, settings
    for name in names:
        with contextlib.suppress(Exception):
            backend.reap(name)
    pool.drain(settings)
    assert not pool_left(settings), pool_left(settings)
    assert_no_mounts_under(settings.data_dir)


def pool_left(settings: Settings) -> list[str]:
    slots = pool.pool_dir(settings) / "slots"
    left = [p.name for p in slots.iterdir()] if slots.is_dir() else []
    return left + [n for n in _containers(pool.SLOT_PREFIX)]


def test_task_through_the_pool(
    pooled: tuple[PodmanBackend, Settings], default_image: str, make_workspace, tmp_path: Path
) -> None:
    backend, settings = pooled
    ws = make_workspace()
    (ws / "in.txt").write_text("from the host\n")
    started = pool.fill(backend, _template(default_image, ws), 1, ttl=120)
    assert len(started) == 1 and _containers(started[0]) == started
    spec = _template(default_image, ws).replace(
        name=f"agentbox-pooltest-{os.getpid()}", env={"GREETING": "hello pool"}
    )
    log = tmp_path / "sandbox.log"
    script = (
        'echo "$GREETING"; pwd; cat in.txt; id -u; echo written > out.txt; echo err >&2; exit 3'
    )
    ended, out, err = _run(backend, spec, ["sh", "-c", script], log)
    assert ended == Exited(3, False)
    assert out.decode().splitlines() == ["hello pool", "/workspace", "from the host", "64000"]
    assert err == b"err\n"
    assert (ws / "out.txt").read_text() == "written\n"
    assert not _containers(spec.name)
    # single use: the pooled sandbox ran the task and is gone, its slot too
    assert not _containers(started[0])
    assert not pool_left(settings)
