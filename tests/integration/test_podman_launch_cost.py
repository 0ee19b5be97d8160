"""A detached podman launch asks podman nothing beyond its own ``podman run -d``.

Each ``podman inspect`` is a podman client start (0.1 s quiet, 0.2-0.4 s on a busy
2-core host). A launch used to run two (a name in use? conmon's pid?) and its
follower a third before reading the first output; conmon's pid now comes from
``--conmon-pidfile`` and the view of the sandbox from what ``launch`` gave podman
(``backends/podman/_launched.py``). Real podman, conmon, runc, relay and workspace
disk; the count is of our calls to podman, through the module's own ``inspect``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends import Exited
from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci._cli import conmon_cwd
from agentbox.backends.podman import _detach
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks need root"),
]


def test_launch_and_follow_ask_podman_nothing_before_the_output(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    podman_boxes: SandboxTracker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws, gw = make_workspace(), make_workspace()
    name = f"launch-cost-{os.getpid()}"
    log = sandbox_settings.data_dir / "launch-cost.log"
    spec = SandboxSpec(name=name, image=default_image, workspace=ws, gateway_dir=gw)
    asked: list[str] = []
    real = _detach.inspect

    def inspect(n: str) -> Any:
        asked.append(n)
        return real(n)

    monkeypatch.setattr(_detach, "inspect", inspect)
    script = "echo out; echo made > /workspace/f; echo err >&2; exit 3"
    podman_boxes.launch(spec, ["sh", "-c", script], log=log)
    assert asked == [], "launch asked podman again after podman run -d"
    before_output: list[int] = []
    out: list[bytes] = []
    err: list[bytes] = []

    def on_stdout(chunk: bytes) -> None:
        if not out:
            before_output.append(len(asked))
        out.append(chunk)

    backend = podman_boxes.backend
    ended = backend.follow(name, log=log, on_stdout=on_stdout, on_stderr=err.append, poll=0.05)
    assert ended == Exited(3, False)
    assert b"".join(out) == b"out\n" and b"".join(err) == b"err\n"
    assert before_output == [0], "the follower asked podman before the first output"
    assert (ws / "f").read_text() == "made\n"  # the workspace disk, copied back
    assert not list(conmon_cwd().glob(f".{name}.*")), "conmon's pid file was left behind"
