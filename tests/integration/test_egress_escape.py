"""The escape probe for the egress proxy, on a real podman sandbox, and its positive control.

From inside, through a real (dropped) proxy: loopback, metadata and private targets,
by name and by literal, must all be refused for their address; the same proxy with
its address checks off must let ``localhost`` through (the control fires). The
sandbox goes through the leak guard (``sandbox_factory``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import BindMount, Sandbox, SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
from agentbox.escape._egress import _verdict, egress_probe
from agentbox.gateway import gateway_identity
from sandbox_leaks import SandboxTracker

INSIDE = "/run/agentbox/egress"


@pytest.fixture
def box(
    settings: Settings,
    tmp_path: Path,
    sandbox_factory: Callable[[PodmanBackend, Settings], SandboxTracker],
) -> Iterator[tuple[Sandbox, Path]]:
    shared = tmp_path / "egress"
    shared.mkdir()
    shared.chmod(0o755)
    spec = SandboxSpec(
        name=f"agentbox-egress-probe-{uuid.uuid4().hex[:8]}",
        image=settings.image,
        runtime=settings.runtime,
        mounts=(BindMount(shared, INSIDE, read_only=True),),
        deadline=600,
        uid=settings.sandbox_uid,
    )
    sandbox = sandbox_factory(PodmanBackend(settings), settings).create(spec)
    try:
        yield sandbox, shared
    finally:
        sandbox.destroy()


@pytest.mark.podman
def test_proxy_refuses_inner_targets_and_the_control_fires(
    settings: Settings, box: tuple[Sandbox, Path]
) -> None:
    sandbox, shared = box
    kw = {"socket_owner": settings.sandbox_host_uid, "run_as": gateway_identity(settings)}
    status, seen = egress_probe(sandbox, shared, INSIDE, **kw)  # type: ignore[arg-type]
    assert status == "pass", seen
    assert "localhost:443=address:loopback" in seen
    assert "169.254.169.254:443=ip-literal" in seen
    status, seen = egress_probe(sandbox, shared, INSIDE, checked=False, **kw)  # type: ignore[arg-type]
    assert status == "fail", seen
    assert "localhost:443 reached" in seen
    assert list(shared.iterdir()) == []  # the probe's socket is gone


def test_verdict_reads_untrusted_results() -> None:
    held = {"target": "a", "status": 403, "rule": "address:loopback"}
    assert _verdict([held])[0] == "pass"
    assert _verdict([held, {"target": "b", "status": 502, "rule": "resolve"}])[0] == "pass"
    assert _verdict([held, {"target": "c", "status": 200, "rule": None}])[0] == "fail"
    assert _verdict([held, {"target": "c", "status": 502, "rule": "connect"}])[0] == "fail"
    assert _verdict([held, {"target": "d", "status": 403, "rule": "not-allowed"}])[0] == "error"
    assert _verdict([])[0] == "error"
    assert _verdict(["junk", 5])[0] == "error"  # type: ignore[list-item]
    gone = {"target": "a", "status": None, "error": "[Errno 2] No such file or directory"}
    assert _verdict([gone, gone])[0] == "n/a"  # the sandbox does not share the directory
    assert _verdict([gone, held])[0] == "error"
