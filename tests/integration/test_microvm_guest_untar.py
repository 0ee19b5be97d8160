"""The guest agent's ``put`` (copy_in): extraction into a directory the workload controls.

The agent runs as root in the guest; ``/workspace`` and ``/tmp`` belong to the
workload, which can plant links there before the host copies something in. These
tests drive the real agent code on this host (as root, like in the guest) with a
real tar stream, a sandbox uid of ``nobody``, and a root-only directory standing
in for what the workload must not reach (``/run``, ``/proc/sys`` in the guest).
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.guest import agent
from agentbox.guest.agent import CTRL, FrameReader, decode_ctrl

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent extracts as root")


@pytest.fixture
def tree(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(the workload's directory, a root-only directory beside it)."""
    # The guest's interpreter is Debian's python3 (this venv's is not nobody's to run).
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    base = Path(tempfile.mkdtemp(prefix="agentbox-untar-test-"))  # pytest's is root-only
    try:
        base.chmod(0o755)
        ws = base / "ws"
        ws.mkdir()
        os.chown(ws, NOBODY, NOBODY)
        secret = base / "rootonly"
        secret.mkdir(mode=0o700)
        yield ws, secret
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _put(archive: bytes, dest: str) -> str:
    """Run the agent's put for ``archive`` at ``dest``; the error it reports ("" if none)."""
    host, guest = socket.socketpair()
    try:
        a = agent.Agent(guest.fileno())
        a.uid = NOBODY
        a.token = "t"
        a.op_put(2, {"op": "put", "dest": dest})
        for i in range(0, len(archive), 4096):
            a.put_chunk(2, archive[i : i + 4096])
        a.put_chunk(2, b"")
        host.settimeout(60)
        r = FrameReader()
        while True:
            for ftype, stream, payload in r.feed(host.recv(65536)):
                if ftype == CTRL and stream == 2:
                    msg = decode_ctrl(payload)
                    assert msg["op"] == "put_ok"
                    return str(msg["error"])
    finally:
        host.close()
        guest.close()


def test_put_extracts_as_the_sandbox_uid(tree: tuple[Path, Path]) -> None:
    ws, _ = tree
    err = _put(_tar([_file("d/f.txt", b"payload", 0o4755), _link("d/l", "f.txt")]), str(ws / "in"))
    assert err == ""
    f = ws / "in/d/f.txt"
    assert f.read_bytes() == b"payload"
    assert (f.stat().st_uid, f.stat().st_gid) == (NOBODY, NOBODY)
    assert (ws / "in/d").stat().st_uid == NOBODY
    assert f.stat().st_mode & 0o7777 == 0o755  # no setuid from a tar
    assert os.readlink(ws / "in/d/l") == "f.txt"


def test_put_never_writes_through_a_link_the_workload_planted(tree: tuple[Path, Path]) -> None:
    ws, secret = tree
    (ws / "in").symlink_to(secret)  # what the workload does before a copy_in lands
    os.lchown(ws / "in", NOBODY, NOBODY)
    err = _put(_tar([_file("x/f.txt", b"planted")]), str(ws / "in"))
    assert list(secret.iterdir()) == []
    assert err, "the put must fail: its destination leads where the workload cannot write"


@pytest.mark.parametrize(
    "members",
    [
        [_link("l", "/ROOTONLY"), _file("l/f.txt", b"x")],  # absolute link, then through it
        [_link("l", "../../rootonly"), _file("l/f.txt", b"x")],  # relative link out
        [_file("../rootonly/f.txt", b"x")],
        [_file("/ROOTONLY/f.txt", b"x")],
    ],
)
def test_put_refuses_members_that_leave_the_destination(
    tree: tuple[Path, Path], members: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    ws, secret = tree
    for info, _ in members:
        info.name = info.name.replace("/ROOTONLY", str(secret))
        info.linkname = info.linkname.replace("/ROOTONLY", str(secret))
    secret.chmod(0o777)  # even where the sandbox uid could write: the data filter's rules
    err = _put(_tar(members), str(ws / "in"))
    assert list(secret.iterdir()) == []
    assert err


def test_put_refuses_device_nodes(tree: tuple[Path, Path]) -> None:
    ws, _ = tree
    info = tarfile.TarInfo("null")
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    err = _put(_tar([(info, None)]), str(ws / "in"))
    assert err
    assert not (ws / "in/null").exists()
