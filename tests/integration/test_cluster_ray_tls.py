"""Ray's TLS across the cluster (issue 33 §1), as the how-to turns it on: the four
``RAY_USE_TLS``/``RAY_TLS_*`` variables in the environment of ``agentbox node start`` and
of the driver. One head on this host (Ray as ``agentbox-node``, token auth), no tasks:
the driver lists the node over TLS; a client with the token but without TLS gets no
answer; a tokenless TLS client is refused (the cluster is not open)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.ray,
    pytest.mark.podman,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="node start makes the node user (root)"),
]

_PLAIN = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"x", b"agentbox", timeout=10)
except Exception as exc:
    print("refused", type(exc).__name__)
    sys.exit(3)
print("answered")
"""


def test_a_tls_cluster_answers_only_tls_clients_with_the_token(
    sandbox_root: Path, default_image: str
) -> None:
    pytest.importorskip("ray", reason="the agentbox[ray] extra is not installed")
    from ray._common.tls_utils import generate_self_signed_tls_certs

    from agentbox.cluster._secure import cluster_is_open, ensure_node_user, keygen

    base = Path(tempfile.mkdtemp(dir=sandbox_root))
    base.chmod(0o711)
    cert, key = generate_self_signed_tls_certs()
    node = ensure_node_user()  # as node start does: Ray (this user) must read the key
    tls = base / "tls"
    tls.mkdir(mode=0o711)
    (tls / "tls.crt").write_text(cert)
    (tls / "tls.key").write_text(key)
    (tls / "tls.key").chmod(0o400)
    os.chown(tls / "tls.key", node.pw_uid, -1)
    for sub in ("data", "repos"):
        (base / sub).mkdir(mode=0o711)
    secrets = keygen(base / "secrets")
    tls_env = {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(tls / "tls.crt"),
        "RAY_TLS_SERVER_KEY": str(tls / "tls.key"),
        "RAY_TLS_CA_CERT": str(tls / "tls.crt"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AGENTBOX_"))}
    env.update(
        AGENTBOX_DATA_DIR=str(base / "data"),
        AGENTBOX_REPOS_ROOT=str(base / "repos"),
        AGENTBOX_CLUSTER_SECRETS=str(secrets),
        **tls_env,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    sessions = Path("/var/lib/agentbox-node/tmp/ray")
    before = set(sessions.glob("session_2*"))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve", "--max-tasks", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        sock = base / "data" / "run" / "launcher.sock"
        end = time.monotonic() + 120
        while not sock.exists():
            assert launcher.poll() is None and time.monotonic() < end, "the launcher died"
            time.sleep(0.2)
        got = subprocess.run(
            [sys.executable, "-m", "agentbox", "node", "start", "--head", "--port",
             address.rsplit(":", 1)[1], "--slots", "1", "--name", "tls0",
             "--ray-arg=--num-cpus=1", "--ray-arg=--object-store-memory=104857600"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr[-3000:]
        listed = subprocess.run(
            [sys.executable, "-m", "agentbox", "node", "list", "--address", address, "--json"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert listed.returncode == 0 and '"node": "tls0"' in listed.stdout, listed.stderr[-2000:]
        # A tokenless client over TLS is refused: the probe finds the cluster closed.
        os.environ.update(tls_env)
        try:
            assert cluster_is_open(address) is False
        finally:
            for k in tls_env:
                os.environ.pop(k, None)
        # A client with the token but without TLS gets no answer.
        token = (secrets / "ray-token").read_text()
        plain = {k: v for k, v in env.items() if not k.startswith("RAY_")}
        plain.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        got = subprocess.run(
            [sys.executable, "-c", _PLAIN, address],
            env=plain, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert got.returncode == 3, got.stdout + got.stderr[-1000:]
    finally:
        subprocess.run([sys.executable, "-m", "agentbox", "node", "stop"], env=env,
                       capture_output=True, timeout=120, check=False)  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(base) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        for old in set(sessions.glob("session_2*")) - before:
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        assert not left, left
