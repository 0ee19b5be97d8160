"""The proxy as its own process (``spawn_proxy``): the real registry this host's pip uses,
reached over a verified TLS tunnel; the process confined as the gateway is; stop and cleanup.

The registry is never named here: it is read from the host's pip, as the code does.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, spawn_proxy, summarize
from agentbox.errors import EgressError
from agentbox.escape._hostcheck import gateway_posture
from agentbox.gateway import gateway_identity

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the proxy drops from root only")


@pytest.fixture(scope="module")
def registry_policy() -> EgressPolicy:
    return EgressPolicy.for_phase(Settings(), registries=True)


def _pip_index(policy: EgressPolicy) -> str:
    """The first https index host this host's pip uses, or skip if none is reachable."""
    rule = next((r for r in policy.rules if r.source == "pip" and 443 in r.tls_ports), None)
    if rule is None:
        pytest.skip("this host's pip has no https index configured")
    try:
        socket.create_connection((rule.pattern, 443), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"pip's index host is unreachable from this host: {exc}")
    return rule.pattern


@pytest.fixture
def task_dir(tmp_path: Path) -> Iterator[Path]:
    """A task dir like the launcher's: root-owned 0700 (a dropped proxy cannot traverse it)."""
    d = tmp_path / "task"
    d.mkdir(mode=0o700)
    yield d


async def _fetch_index(sock: Path, host: str, ca: Path) -> tuple[bytes, bytes]:
    r, w = await asyncio.open_unix_connection(str(sock))
    w.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
    if not head.startswith(b"HTTP/1.1 200"):
        w.close()
        return head, b""
    ctx = ssl.create_default_context(cafile=str(ca))  # verification on, the host's bundle
    await w.start_tls(ctx, server_hostname=host)
    w.write(f"GET /simple/ HTTP/1.1\r\nHost: {host}\r\nAccept: text/html\r\n"
            "Range: bytes=0-4095\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
    body = await asyncio.wait_for(r.read(), 60)
    w.close()
    return head, body


def test_real_registry_through_spawned_proxy(task_dir: Path, registry_policy: EgressPolicy) -> None:
    host = _pip_index(registry_policy)
    settings = Settings()
    ca = host_ca_bundle(settings)
    log_path = task_dir / "egress.log"
    sock, err = task_dir / "egress.sock", task_dir / "egress.err"
    identity = gateway_identity(settings)
    with spawn_proxy(sock, registry_policy, log_path, identity, stderr_file=err) as proxy:
        head, body = asyncio.run(_fetch_index(task_dir / "egress.sock", host, ca))
        assert head.startswith(b"HTTP/1.1 200"), head
        status = body.split(b"\r\n", 1)[0]
        assert status.split()[1] in (b"200", b"206"), status
        assert proxy.alive()
    recs = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert [(r["host"], r["decision"], r["status"]) for r in recs] == [(host, "allowed", 200)]
    assert recs[0]["rule"].startswith("pip:") and recs[0]["bytes_down"] > 1000
    summary = summarize(log_path)
    assert summary.hosts[0].host == host and summary.allowed == 1


@root_only
def test_spawned_proxy_is_confined_like_the_gateway(task_dir: Path) -> None:
    settings = Settings()
    identity = gateway_identity(settings)
    assert identity is not None
    policy = EgressPolicy()
    with spawn_proxy(task_dir / "egress.sock", policy, task_dir / "egress.log", identity) as p:
        checks = {c[0]: c for c in gateway_posture(p.pid, want_uid=identity[0])}
        assert all(ok for _, ok, _ in checks.values()), checks
        mode = (task_dir / "egress.sock").stat().st_mode & 0o777
        assert mode == 0o660
    # Positive control: the same proxy without run_as fails the same checks.
    with spawn_proxy(task_dir / "egress.sock", policy, task_dir / "egress2.log") as weak:
        failed = {c[0] for c in gateway_posture(weak.pid, want_uid=identity[0]) if not c[1]}
    assert {"gateway.uid", "gateway.caps", "gateway.no_new_privs", "gateway.seccomp"} <= failed


def test_stop_is_idempotent_and_leaves_nothing(task_dir: Path) -> None:
    sock = task_dir / "egress.sock"
    proxy = spawn_proxy(sock, EgressPolicy(), task_dir / "egress.log")
    pid = proxy.pid
    assert sock.exists() and proxy.alive()
    proxy.stop()
    proxy.stop()
    assert not proxy.alive() and proxy.returncode is not None
    assert not sock.exists()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_start_failure_names_the_cause(task_dir: Path) -> None:
    with pytest.raises(EgressError, match=r"cannot open the egress log .*No such file"):
        spawn_proxy(task_dir / "egress.sock", EgressPolicy(), task_dir / "no/such/dir/egress.log",
                    stderr_file=task_dir / "egress.err")  # fmt: skip
    assert not (task_dir / "egress.sock").exists()
