"""A podman sandbox with no NIC reaches the host's registry only via relay → socket → proxy.

The sandbox is the hardened podman one (``--network none``, read-only root, no
capabilities, uid 64000). Inside, the in-sandbox relay listens on 127.0.0.1:3128
and carries each connection to the proxy's unix socket, mounted read-only with
the host's CA bundle beside it; the command gets :func:`proxy_env`. Checked in the
same sandbox: the registry answers through the proxy (TLS verified against the host
bundle), a host outside the allow-list is refused by the proxy (403), and without the
proxy there is no way out at all. The sandbox goes through the leak guard
(``sandbox_factory``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends.base import BindMount, SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, proxy_env, spawn_proxy, summarize
from agentbox.gateway import gateway_identity
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.podman

INSIDE = "/run/agentbox/egress"
RELAY = ["python3", "/opt/agentbox/relay.py", "--port", "3128", "--socket", f"{INSIDE}/egress.sock"]
FETCH = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
        print(json.dumps({"status": r.status, "bytes": len(r.read())}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""
FETCH = "import json\n" + FETCH


def _index_host(policy: EgressPolicy) -> str:
    rule = next((r for r in policy.rules if r.source == "pip" and 443 in r.tls_ports), None)
    if rule is None:
        pytest.skip("this host's pip has no https index configured")
    try:
        socket.create_connection((rule.pattern, 443), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"pip's index host is unreachable from this host: {exc}")
    return rule.pattern


def _fetch(box: object, url: str, env: dict[str, str], *, relay: bool) -> dict[str, object]:
    argv = [*RELAY, "--", "python3", "-c", FETCH, url] if relay else ["python3", "-c", FETCH, url]
    res = box.exec(argv, env=env, timeout=120)  # type: ignore[attr-defined]
    out = res.stdout.decode(errors="replace").strip().splitlines()
    assert out, (res.exit_code, res.stderr[-2000:])
    return json.loads(out[-1])  # type: ignore[no-any-return]


def test_sandbox_reaches_registry_only_through_the_proxy(
    settings: Settings,
    tmp_path: Path,
    sandbox_factory: Callable[[PodmanBackend, Settings], SandboxTracker],
) -> None:
    policy = EgressPolicy.for_phase(settings, registries=True)
    host = _index_host(policy)
    egress = tmp_path / "egress"
    egress.mkdir()
    egress.chmod(0o755)
    ca = egress / "ca.pem"
    shutil.copyfile(host_ca_bundle(settings), ca)
    ca.chmod(0o444)
    sock, log_path = egress / "egress.sock", tmp_path / "egress.log"
    backend = PodmanBackend(settings)
    spec = SandboxSpec(
        name=f"agentbox-egress-{uuid.uuid4().hex[:8]}",
        image=settings.image,
        runtime=settings.runtime,
        mounts=(BindMount(egress, INSIDE, read_only=True),),
        deadline=600,
        uid=settings.sandbox_uid,
    )
    with spawn_proxy(sock, policy, log_path, gateway_identity(settings)):
        # The sandbox's relay runs as the sandbox uid: let it (and only it) connect.
        os.chown(sock, settings.sandbox_host_uid, settings.sandbox_host_uid)
        box = sandbox_factory(backend, settings).create(spec)
        try:
            env = proxy_env(3128, f"{INSIDE}/ca.pem")
            got = _fetch(box, f"https://{host}/simple/", env, relay=True)
            assert got.get("status") == 200 and int(got["bytes"]) > 1000, got  # type: ignore[call-overload]
            # The relay started by the first command keeps serving in the background.
            refused = _fetch(box, "https://not-allowed.example.test/", env, relay=False)
            assert "403" in str(refused.get("error")), refused
            # Without the proxy (no proxy variables) the sandbox has no way out at all.
            alone = _fetch(box, f"https://{host}/simple/", {}, relay=False)
            assert "error" in alone, alone
            posture = {c.name: c for c in box.posture().checks}
        finally:
            box.destroy()
    assert posture["network interfaces"].ok, posture["network interfaces"]  # only lo
    summary = summarize(log_path)
    by = {h.host: h for h in summary.hosts}
    assert by[host].allowed == 1 and by[host].bytes_down > 1000
    assert by["not-allowed.example.test"].denied == 1
    assert by["not-allowed.example.test"].denied_rules == ["not-allowed"]
