"""The escape probe for brokered secrets, on a real podman sandbox, and its positive control.

A fresh secret is planted in a store, resolved for a rule that injects it and held by a
real (dropped) egress proxy whose socket the sandbox sees; from inside, the value must be
in no proxy answer, no process's environment or command line and no mounted file. The
control plants it in a mounted file and in a process's environment, where the probe must
find it. The sandbox goes through the leak guard (``sandbox_factory``).
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import BindMount, Sandbox, SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
from agentbox.escape._secret import _verdict, secret_probe
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
        name=f"agentbox-secret-probe-{uuid.uuid4().hex[:8]}",
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
def test_the_secret_is_not_in_the_sandbox_and_the_control_fires(
    settings: Settings, box: tuple[Sandbox, Path]
) -> None:
    sandbox, shared = box
    run_as = gateway_identity(settings)
    status, seen = secret_probe(sandbox, shared, INSIDE, run_as=run_as)
    assert status == "pass", seen
    assert "proxy: TLS: HTTP/1.1" in seen  # the proxy answered, for the rule's host

    def in_a_file(value: str) -> None:
        (shared / "leaked.env").write_text(f"TOKEN={value}\n")

    status, seen = secret_probe(sandbox, shared, INSIDE, run_as=run_as, plant=in_a_file)
    assert status == "fail" and f"{INSIDE}/leaked.env" in seen, seen
    (shared / "leaked.env").unlink()

    def in_an_environment(value: str) -> None:
        subprocess.run(
            ["podman", "exec", "-d", "-e", f"LEAKED={value}", sandbox.name, "sleep", "60"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    status, seen = secret_probe(sandbox, shared, INSIDE, run_as=run_as, plant=in_an_environment)
    assert status == "fail" and "/environ" in seen, seen
    assert sorted(p.name for p in shared.iterdir()) == []  # the probe's socket is gone


def test_verdict_reads_untrusted_results() -> None:
    ran = {"files": 10, "bytes": 100, "procs": 3}
    assert _verdict({"found": [], "scanned": ran, "answers": ["TLS: HTTP/1.1 502"]})[0] == "pass"
    assert _verdict({"found": ["/proc/1/environ"], "scanned": ran})[0] == "fail"
    assert _verdict({"found": [], "scanned": {"files": 0}})[0] == "error"
    assert _verdict({"found": "x"})[0] == "error"
    assert _verdict("junk")[0] == "error"
    gone = "TLS: [Errno 2] No such file or directory"
    assert _verdict({"found": [], "scanned": ran, "answers": [gone, gone]})[0] == "n/a"
