"""A container whose ``podman rm`` was cut short is finished off, not a task failure.

Seen in the live-restore chaos test: a launcher killed (with its cgroup) while its
``podman rm`` ran left a container record whose storage was already gone; every
``podman inspect`` then failed with "layer not known" and the re-adopting launcher
failed a task that had ended well. Like "container not known" (a removal that
finished), it means the sandbox is gone: the removal is completed and the follower
goes on from the end its predecessor recorded. A stand-in ``podman`` on ``PATH``
answers as podman 4.3 does in that state.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agentbox.backends.podman._detach import inspect
from agentbox.errors import SandboxError

LAYER_GONE = 'Error: reading information about layer "9fd409c2": layer not known'


def _stand_in(tmp_path: Path, inspect_err: str) -> Path:
    calls = tmp_path / "calls"
    script = tmp_path / "bin" / "podman"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$1" = container ] && [ "$2" = inspect ]; then\n'
        f"  echo '{inspect_err}' >&2; exit 125\n"
        "fi\n"
        "exit 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return calls


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_a_half_removed_container_is_removed_and_reported_gone(on_path: Path) -> None:
    calls = _stand_in(on_path, LAYER_GONE)
    assert inspect("agentbox-task-x") is None
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("container inspect")
    assert lines[1:] == ["rm --force --ignore --time 0 agentbox-task-x"]


def test_other_inspect_errors_still_raise(on_path: Path) -> None:
    calls = _stand_in(on_path, "Error: database is locked")
    with pytest.raises(SandboxError, match="database is locked"):
        inspect("agentbox-task-x")
    assert len(calls.read_text().splitlines()) == 1  # nothing removed
