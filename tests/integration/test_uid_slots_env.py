"""A frozen environment made by a sandbox of another uid slot is the task's own to write
(issue 33 §9): its files are given to the task's uid in the task's overlay only, as
metadata copies (the frozen tree and its data never change)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.env._mount import EnvMount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts and chown need root")

FROZE, TASK = 295072, 360608  # the sandbox uids of slots 0 and 1 (defaults)


def _du(path: Path) -> int:
    return sum((Path(d) / f).lstat().st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


def test_a_frozen_env_of_another_slot_is_given_to_the_task_uid(tmp_path: Path) -> None:
    lower = tmp_path / "frozen"
    venv = lower / ".venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "big.so").write_bytes(b"\0" * 8 * 1024 * 1024)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (lower / "root-made").mkdir()
    for p in [venv, venv / "lib", venv / "lib" / "big.so", venv / "bin", venv / "bin" / "python"]:
        os.chown(p, FROZE, FROZE, follow_symlinks=False)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    env = EnvMount(lower, tmp_path / "task-env")
    try:
        env.mount(workspace, [".venv"], TASK)
        merged = env.merged / ".venv"
        for p in [merged, merged / "lib", merged / "lib" / "big.so", merged / "bin" / "python"]:
            st = p.lstat()
            assert (st.st_uid, st.st_gid) == (TASK, TASK), p
        # The frozen tree is untouched, and the task's layer holds no copy of the data.
        assert (venv / "lib" / "big.so").stat().st_uid == FROZE
        assert (venv / "bin" / "python").lstat().st_uid == FROZE
        assert _du(env.layer) < 1024 * 1024
        assert (env.merged / "root-made").stat().st_uid == 0
    finally:
        env.release()
