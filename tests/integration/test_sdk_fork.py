"""``Sandbox.fork(n)`` on podman, docker and qemu (podman also in tests/integration/test_sdk.py,
as a member of the group agentbox): a file written before the fork is in every fork, a write in one
fork is in neither another nor the parent; each fork is a sandbox of the same backend with
its own deadline, removed with its ``with``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.sdk import Sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root")


@pytest.fixture
def launcher_sock() -> Iterator[tuple[Path, Path]]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-sdk-fork-", dir="/var/tmp"))
    base.chmod(0o711)
    env = {"PATH": os.environ["PATH"], "HOME": str(base), "AGENTBOX_DATA_DIR": str(base / "data"),
           "AGENTBOX_LOG_LEVEL": "info"}  # fmt: skip
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    log = base / "launcher.log"
    with log.open("wb") as err:
        serve = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        sock = base / "data" / "launcher.sock"
        for _ in range(600):
            if sock.exists():
                break
            assert serve.poll() is None, "the launcher exited"
            time.sleep(0.1)
        yield sock, log
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(base, ignore_errors=True)


BACKENDS = [
    pytest.param("podman", marks=pytest.mark.podman),
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("qemu", marks=pytest.mark.qemu),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_copies_the_files_and_keeps_the_copies_apart(
    launcher_sock: tuple[Path, Path], backend: str
) -> None:
    sock, log = launcher_sock
    with Sandbox.create(backend=backend, timeout=600, address=sock) as sb:
        sb.files.write("/workspace/before.txt", "parent\n")
        sb.files.write("/tmp/t.txt", "tmpfs\n")
        forks = sb.fork(2, timeout=300)
        try:
            assert len({sb.id, *(f.id for f in forks)}) == 3
            assert all(f.info.backend == backend for f in forks)
            assert all(290 <= f.info.deadline_at - time.time() <= 300 for f in forks)
            for f in forks:
                assert f.files.read("/workspace/before.txt") == "parent\n"
                assert f.files.read("/tmp/t.txt") == "tmpfs\n"
            f1, f2 = forks
            r = f1.commands.run("echo one >> /workspace/before.txt && echo 1 > /workspace/only1")
            assert r.exit_code == 0, r
            assert f1.files.read("/workspace/before.txt") == "parent\none\n"
            assert f2.files.read("/workspace/before.txt") == "parent\n"
            assert sb.files.read("/workspace/before.txt") == "parent\n"
            assert f2.commands.run("test -e /workspace/only1").exit_code == 1
            assert sb.commands.run("test -e /workspace/only1").exit_code == 1
        finally:
            for f in forks:
                f.close()
        live = {i.id for i in Sandbox.list(address=sock)}
        assert not live & {f.id for f in forks} and sb.id in live
    said = log.read_text(errors="replace")
    print("\n".join(ln for ln in said.splitlines() if "fork" in ln))
    if backend in ("podman", "docker"):  # the frozen parent copied on the host, not inside
        assert "sdk sandbox forked" in said and "copying inside instead" not in said
