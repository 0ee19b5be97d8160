"""conmon's exit file and pid file are read only as small regular files of the right
owner: a link is not followed, a FIFO is not waited on, a big or foreign file is not
read (the paths lie in directories podman shares with the container's runtime)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.backends.podman._exitfile import read_exit_file, read_owned_note

ME = os.geteuid()


def test_a_small_regular_file_of_the_owner_is_read(tmp_path: Path) -> None:
    f = tmp_path / "exit"
    f.write_text("137\n")
    got = read_owned_note(f, uid=ME, limit=64)
    assert got is not None and got[0] == "137"
    if ME == 0:
        assert read_exit_file(f) == (137, f.stat().st_mtime)


@pytest.mark.parametrize("what", ["link", "fifo", "big", "other owner", "missing"])
def test_anything_else_is_refused(tmp_path: Path, what: str) -> None:
    target = tmp_path / "real"
    target.write_text("0\n")
    f = tmp_path / "exit"
    uid = ME
    if what == "link":
        f.symlink_to(target)
    elif what == "fifo":
        os.mkfifo(f)  # opened non-blocking: no writer, no wait
    elif what == "big":
        f.write_text("1" * 65)
    elif what == "other owner":
        f.write_text("0\n")
        uid = ME + 1
    assert read_owned_note(f, uid=uid, limit=64) is None


def test_an_exit_file_that_is_not_a_number_yet_is_no_end(tmp_path: Path) -> None:
    f = tmp_path / "exit"
    f.write_text("")
    assert read_exit_file(f) is None
    f.write_text("12a")
    assert read_exit_file(f) is None
    assert read_exit_file(None) is None
