"""A command the front end serves keeps its channel to the server's gateway template
whatever its caller's posture (front/_child.py): the template's child takes on what a
gateway exec'd by the command would inherit (tests/integration/test_gateway_template.py
holds that posture equal), so a caller whose nice value, umask and limits are not the
server's (a user's shell against a ``launcher serve`` unit) forks its gateway there too.

The real fork server and client (tests/integration/test_front_end.py's ``Front``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_front_end
from test_front_end import AGENTBOX, Front, front  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the front end serves root's commands")


def _seqpacket_sockets(pid: int) -> int:
    """How many ``SOCK_SEQPACKET`` unix sockets ``pid`` holds (a template channel is one)."""
    seqpacket = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 7 and cols[4] == "0005":
            seqpacket.add(cols[6])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue
        if target.startswith("socket:[") and target[8:-1] in seqpacket:
            held += 1
    return held


@pytest.mark.parametrize("differs", [False, True])
def test_the_command_keeps_its_template_channel(front: Front, differs: bool) -> None:  # noqa: F811
    def preexec() -> None:
        if differs:
            os.nice(5)
            os.umask(0o027)
            resource.setrlimit(resource.RLIMIT_NOFILE, (777, 888))

    client = subprocess.Popen(
        [*AGENTBOX, "run", "--repo", "rel/dir", "-"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=front.work,
        env=front.env("require"), preexec_fn=preexec,
    )  # fmt: skip
    try:
        cmd = front.command_of()
        test_front_end._reading_stdin(cmd.pid)  # set up, and at work
        if differs:
            assert os.getpriority(os.PRIO_PROCESS, cmd.pid) == 5  # served, as its caller
        assert _seqpacket_sockets(cmd.pid) == 1
        _, err = client.communicate(b"", timeout=60)  # an empty task: exit 2
        assert client.returncode == 2, err
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
