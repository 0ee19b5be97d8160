"""What ``launch`` trusts of ``podman run -d``'s answer (backends/podman/_launched.py).

conmon's pid file is believed only as a regular file of ours naming a live ``conmon``
that monitors that very container; anything else means "ask podman" (None). Real
files and processes; the podman path is tests/integration/test_podman_launch_cost.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman._launched import (
    conmon_and_view,
    container_id,
    started_conmon,
    with_pidfile,
)

CID = "a" * 64


def test_the_pid_file_goes_right_after_run() -> None:
    args, path = with_pidfile(["podman", "--runtime", "runc", "run", "-d", "img"], "box")
    assert args[:6] == ["podman", "--runtime", "runc", "run", "--conmon-pidfile", str(path)]
    assert args[6:] == ["-d", "img"]
    assert path.name.startswith(".box.") and not path.exists()
    assert path.parent.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("stdout", "cid"),
    [(CID + "\n", CID), ("warning\n" + CID + "\n", CID), ("", None), ("x" * 64, None),
     (CID[:-1], None)],
)  # fmt: skip
def test_the_container_id_is_podman_s_last_line(stdout: str, cid: str | None) -> None:
    assert container_id(stdout) == cid


def _pidfile(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.pid"
    p.write_text(text)
    return p


def test_a_pid_that_is_not_a_conmon_is_not_believed(tmp_path: Path) -> None:
    p = _pidfile(tmp_path, str(os.getpid()))
    assert started_conmon(p, CID) is None
    assert not p.exists()  # read once, then gone


@pytest.mark.parametrize(("monitored", "believed"), [("b" * 64, False), (CID, True)])
def test_only_the_conmon_of_that_container_is_believed(
    tmp_path: Path, monitored: str, believed: bool
) -> None:
    # A process named conmon (its comm) whose ``-c`` names a container.
    fake = tmp_path / "conmon"
    fake.symlink_to(sys.executable)
    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(30)\n")
    proc = subprocess.Popen([str(fake), "-S", str(script), "-c", monitored])
    try:
        for _ in range(500):  # until the exec is done (comm and cmdline are the new ones)
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "conmon":
                break
            time.sleep(0.01)
        got = started_conmon(_pidfile(tmp_path, str(proc.pid)), CID)
        assert (got is not None and got.pid == proc.pid) == believed
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("text", ["", "abc", "12 13", "-1", "9" * 40])
def test_garbage_is_not_believed(tmp_path: Path, text: str) -> None:
    assert started_conmon(_pidfile(tmp_path, text), CID) is None


def test_a_link_or_a_missing_file_is_not_followed(tmp_path: Path) -> None:
    target = _pidfile(tmp_path, str(os.getpid()))
    link = tmp_path / "link.pid"
    link.symlink_to(target)
    assert started_conmon(link, CID) is None
    assert started_conmon(tmp_path / "absent.pid", CID) is None


def test_no_view_without_a_trusted_conmon(tmp_path: Path) -> None:
    spec = SandboxSpec(name="box", image="x")
    p = _pidfile(tmp_path, str(os.getpid()))
    assert conmon_and_view(CID + "\n", p, spec, 0.0) == (None, None)
