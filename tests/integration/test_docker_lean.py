"""Listing the docker backend's sandboxes never imports the docker SDK.

A launcher lists every backend's sandboxes when it starts (reconcile:
``backends.owned_sandboxes``), docker included even where docker is unused. The
SDK (``docker``, ``requests``, ``urllib3``: 0.3-0.9 s of imports) is loaded only
when a sandbox is made or reaped; the list is one allow-listed ``GET
/containers/json`` over the unix socket, and a missing socket lists nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from agentbox.backends.base import LABEL, OWNER_DATA_LABEL, data_dir_label
from agentbox.backends.docker import DockerBackend
from agentbox.config import Settings

# The reconcile call, in a fresh interpreter: what it found, and the SDK's modules it loaded.
_PROBE = """
import json, sys
from agentbox.backends import owned_sandboxes
from agentbox.config import Settings
found = owned_sandboxes(Settings())
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("docker", "requests", "urllib3"))
print(json.dumps({"found": found, "heavy": heavy}))
"""


def _reconcile(data_dir: Path, docker_host: str) -> dict[str, list[object]]:
    env = {**os.environ, "AGENTBOX_DATA_DIR": str(data_dir), "DOCKER_HOST": docker_host}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got: dict[str, list[object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def test_no_docker_daemon_lists_nothing_and_imports_no_sdk(tmp_path: Path) -> None:
    got = _reconcile(tmp_path / "data", f"unix://{tmp_path}/no-docker.sock")
    assert got["heavy"] == []
    assert [b for b, _ in got["found"]] == []  # type: ignore[misc]


@pytest.mark.docker
def test_a_left_docker_sandbox_is_found_without_the_sdk(tmp_path: Path) -> None:
    """A container a dead launcher of this data dir left is still listed, by the light path."""
    data_dir = tmp_path / "data"
    tag = f"agentbox-test-empty:{uuid.uuid4().hex[:12]}"
    name = f"agentbox-task-lean-{uuid.uuid4().hex[:8]}"
    empty = subprocess.run(["tar", "cf", "-", "--files-from", "/dev/null"], capture_output=True)
    subprocess.run(["docker", "import", "-", tag], input=empty.stdout, check=True,
                   capture_output=True)  # fmt: skip
    try:
        subprocess.run(["docker", "create", "--name", name, "--label", f"{LABEL}=1",
                        "--label", f"{OWNER_DATA_LABEL}={data_dir_label(data_dir)}",
                        tag, "/none"], check=True, capture_output=True)  # fmt: skip
        try:
            got = _reconcile(data_dir, "unix:///var/run/docker.sock")
        finally:
            subprocess.run(["docker", "rm", "-f", name], check=True, capture_output=True)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], check=True, capture_output=True)
    assert got["found"] == [["docker", name]]
    assert got["heavy"] == []


def _answer_once(path: Path, answer: bytes) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        (b'[{"Names": ["/agentbox-task-a"]}, 7, {"Names": "x"}, {}]', ["agentbox-task-a"]),
        (b'{"message": "not a list"}', []),
        (b"[not json", []),
    ],
)
def test_the_daemons_answer_is_parsed_defensively(
    tmp_path: Path, answer: bytes, found: list[str]
) -> None:
    """A daemon's list is untrusted input: entries that are not containers are dropped,
    an answer that is not a JSON list lists nothing; the call is allow-listed and recorded."""
    sock = tmp_path / "docker.sock"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    t = _answer_once(sock, head % len(answer) + answer)
    backend = DockerBackend(Settings(data_dir=tmp_path / "data"), base_url=f"unix://{sock}")
    try:
        assert backend.owned() == found
        assert backend.client.endpoints == ["GET /containers/json"]
    finally:
        backend.client.close()
        t.join(10)
