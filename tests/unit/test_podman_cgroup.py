"""``born_outside``'s shell step (real ``sh``): it enters each named ``cgroup.procs``
with its own pid, says and skips one it cannot enter, then ``exec``s the command
(the same pid, so what the command forks starts where the shell went)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.backends.podman import _cgroup as _podman_cgroup
from agentbox.core import proc as _proc


def test_the_shell_enters_each_file_then_execs_the_command(tmp_path: Path) -> None:
    a, b = tmp_path / "a.procs", tmp_path / "b.procs"
    a.write_text("")
    b.write_text("")
    bad = tmp_path / "no-such-dir" / "cgroup.procs"
    argv = ["sh", "-c", _podman_cgroup._ENTER, "sh", str(a), str(bad), str(b), "--"]
    res = _proc.run([*argv, "sh", "-c", 'echo "$$"; echo "$@"', "x", "--", "y z"], check=False)
    assert res.returncode == 0, res.stderr
    pid, args = res.stdout.splitlines()
    assert a.read_text().strip() == pid == b.read_text().strip()  # exec: the same process
    assert args == "-- y z"  # arguments after the separator pass through untouched
    assert f"agentbox: could not enter {bad}" in res.stderr


def test_no_unit_to_leave_leaves_the_argv_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_podman_cgroup, "cgroups_of", lambda pid: {"name=systemd": "/", "0": "/"})
    assert _podman_cgroup.born_outside(["podman", "run", "-d"]) == ["podman", "run", "-d"]
